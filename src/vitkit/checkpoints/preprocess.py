"""A checkpoint's evaluation-time preprocessing: resize, normalise (decoding is :mod:`vitkit.images`).

A checkpoint carries its :class:`Preprocess`, so ``predict`` and ``eval`` feed a model exactly what it
was trained on. Two resize modes cover the common conventions:

- ``"squash"``: resize straight to (H, W), ignoring aspect ratio (official ``vit_jax`` eval and Hugging
  Face's ViT image processor);
- ``"crop"``: resize the shorter side to size / crop_pct, then centre-crop (timm, DeiT); only the crop's
  source box is resized, and images too elongated for a crop are refused (:meth:`Preprocess.crop_box`);
- ``"shortest"``: Hugging Face's ``size: {shortest_edge: S}`` + ``crop_size`` (BitImageProcessor, DINOv2): the
  shorter side to S = round(min(H, W) / crop_pct), the longer one truncated (``int(S * long / short)``), then
  the centre (H, W) from offset ``(resized - crop) // 2``;
- ``"squash_crop"``: Hugging Face's ``size: {height, width}`` + ``crop_size`` (DeiTImageProcessor): squash to
  (round(H / crop_pct), round(W / crop_pct)), then the same centre crop.

Every mode but ``"squash"`` resizes only the crop's source box (:meth:`Preprocess.crop_box`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from numbers import Integral
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.images import ImageTooLarge, convert_image, load_image, max_image_pixels

INCEPTION_MEAN = (0.5, 0.5, 0.5)  # official ViT: inputs scaled to [-1, 1]
INCEPTION_STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI's (transformers' OPENAI_CLIP_MEAN / STD)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# A centre crop refuses images more elongated than this (a 30000x1 PNG of 200 bytes is not a photograph)
MAX_ASPECT_RATIO = 1000
#: The largest side of a preprocessing size (the model's own bound; a checkpoint's preprocessing is held to
#: its model's image size by :func:`vitkit.checkpoints.loaded.check_preprocess`)
MAX_SIDE = 1 << 16

RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# the interpolations PyTorch resizes as Pillow does (antialiased uint8 kernels), by ``F.interpolate``'s mode name
TORCH_RESIZE = {"bilinear": "bilinear", "bicubic": "bicubic"}
RESIZE_MODES = ("squash", "crop", "shortest", "squash_crop")


@dataclass(frozen=True)
class Preprocess:
    """How to turn an image file into the model's input tensor."""

    image_size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = INCEPTION_MEAN
    std: tuple[float, float, float] = INCEPTION_STD
    resize: str = "squash"  # one of RESIZE_MODES (module docstring)
    crop_pct: float = 1.0
    interpolation: str = "bilinear"
    grayscale: bool = False  # single-channel models (e.g. the bundled digits) read images as "L"

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", _size_pair(self.image_size))
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        if self.interpolation not in RESAMPLE:
            raise ValueError(f"interpolation must be one of {', '.join(RESAMPLE)}, got {self.interpolation!r}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")

    @property
    def channels(self) -> int:
        return 1 if self.grayscale else 3

    @cached_property
    def _mean(self) -> np.ndarray:
        return np.asarray(self.mean[: self.channels], dtype=np.float32)

    @cached_property
    def _std(self) -> np.ndarray:
        return np.asarray(self.std[: self.channels], dtype=np.float32)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("image_size", "mean", "std"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        return cls(**kwargs)

    # ---- application -----------------------------------------------------------------------------

    def resized(self, img: Image.Image, name: str = "image") -> Image.Image:
        """``img`` at ``image_size``: squashed, or shorter side scaled then centre-cropped (only the crop's source
        box is resized: see :meth:`crop_box`). ``name`` identifies the image in errors."""
        H, W = self.image_size
        resample = RESAMPLE[self.interpolation]
        if img.size == (W, H) and (self.resize == "squash" or self.crop_pct == 1.0):
            return img  # resizing to the same size is the identity
        if self.resize == "squash":
            return img.resize((W, H), resample)
        return img.resize((W, H), resample, box=self.crop_box(img.width, img.height, name))

    def resize_target(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(resized width, resized height, crop left, crop top) of :meth:`resized` for an image of ``width`` x
        ``height``: squash straight to the image size, or shorter side to size / crop_pct then the centre crop."""
        H, W = self.image_size
        if self.resize == "squash":
            return W, H, 0, 0
        if self.resize == "squash_crop":
            new_w, new_h = round(W / self.crop_pct), round(H / self.crop_pct)
        elif self.resize == "shortest":  # transformers' get_resize_output_image_size(default_to_square=False)
            short = round(min(H, W) / self.crop_pct)
            long = int(short * max(width, height) / min(width, height))
            new_w, new_h = (short, long) if width <= height else (long, short)
            new_w, new_h = max(W, new_w), max(H, new_h)  # (transformers pads a crop larger than the image)
        else:
            scale = max(H / height, W / width) / self.crop_pct
            new_w, new_h = max(W, round(width * scale)), max(H, round(height * scale))
        return new_w, new_h, (new_w - W) // 2, (new_h - H) // 2

    def crop_box(self, width: int, height: int, name: str = "image") -> tuple[float, float, float, float]:
        """Crop mode: the part of a ``width`` x ``height`` image that becomes the model input, in its own pixels
        (left, top, right, bottom). The input is the centre (H, W) of the image resized so that its shorter side
        is size / crop_pct; Pillow maps output pixel centres to source coordinates the same way whether it
        resizes the whole image or a box, so resizing this box gives those pixels without allocating the
        resized image (to within the last bit of a sample position; exactly where scales are powers of two).

        Raises :class:`ImageTooLarge` naming ``name`` for an image more elongated than
        :data:`MAX_ASPECT_RATIO`, or one that the resize before cropping would take over the decoder's pixel
        limit (:func:`max_image_pixels`): a line of pixels asking for a resize of billions of pixels.
        """
        H, W = self.image_size
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ImageTooLarge(
                f"{name}: image of {width}x{height} has an aspect ratio of {width}:{height}, over the limit of "
                f"{MAX_ASPECT_RATIO}:1 for a centre crop"
            )
        new_w, new_h, left, top = self.resize_target(width, height)  # the crop in the resized image's pixels
        limit = max_image_pixels()
        if limit is not None and new_w * new_h > limit:
            raise ImageTooLarge(
                f"{name}: a centre crop resizes the {width}x{height} image to {new_w}x{new_h} = {new_w * new_h} "
                f"pixels before cropping, over the limit of {limit} pixels"
            )
        # source = resized * (width / new_w); products first, so the right/bottom edge is exact (never > width)
        return (left * width / new_w, top * height / new_h, (left + W) * width / new_w, (top + H) * height / new_h)

    def check_size(self, width: int, height: int, name: str = "image") -> None:
        """Raise :class:`ImageTooLarge` naming ``name`` when preprocessing a ``width`` x ``height`` image would
        be refused (crop mode: see :meth:`crop_box`), so a batch can be checked before any work."""
        if self.resize != "squash":
            self.crop_box(width, height, name)

    def to_tensor(self, img: Image.Image, name: str = "image") -> torch.Tensor:
        """A decoded image -> normalised float tensor (C, H, W). ``name`` identifies it in errors."""
        self.check_size(img.width, img.height, name)  # before the mode conversion's copy
        img = convert_image(img, "L" if self.grayscale else "RGB")
        return normalize(np.asarray(self.resized(img, name)), self._mean, self._std)

    def __call__(self, path_or_image: str | os.PathLike[str] | Image.Image) -> torch.Tensor:
        if isinstance(path_or_image, Image.Image):
            return self.to_tensor(path_or_image)
        return self.to_tensor(load_image(path_or_image), os.fspath(path_or_image))


def _size_pair(size: Any) -> tuple[int, int]:
    """An image size (an int, or two) as (H, W) of whole numbers in 1..MAX_SIDE; ValueError otherwise."""
    pair = [size, size] if isinstance(size, Integral) else list(size) if isinstance(size, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(s, Integral) and not isinstance(s, bool) for s in pair):
        raise ValueError(f"image_size must be an integer or two, got {size!r}")
    h, w = int(pair[0]), int(pair[1])
    if not (1 <= h <= MAX_SIDE and 1 <= w <= MAX_SIDE):
        raise ValueError(f"image_size [{h}, {w}] is outside 1..{MAX_SIDE} pixels per side")
    return h, w


def normalize(arr: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """uint8 pixels (H, W[, C]) -> float32 (C, H, W), ``(x / 255 - mean) / std`` per channel in float32.

    Channel by channel on contiguous planes: numpy broadcasting over a last axis of 3 runs its inner loop
    three elements at a time (9x slower at 224 px); the arithmetic, and so every bit, is the same."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    out = np.empty((arr.shape[2], arr.shape[0], arr.shape[1]), dtype=np.float32)  # (C, H, W)
    for c in range(arr.shape[2]):
        plane = out[c]
        np.divide(arr[:, :, c], np.float32(255.0), out=plane, dtype=np.float32)
        np.subtract(plane, mean[c], out=plane)
        np.divide(plane, std[c], out=plane)
    return torch.from_numpy(out)
