"""A checkpoint's evaluation-time preprocessing: decode an image file, resize, normalise. Pillow and numpy only.

A checkpoint carries its :class:`Preprocess`, so ``predict`` and ``eval`` feed a model exactly what it
was trained on. Two resize modes cover the common conventions:

- ``"squash"``: resize straight to (H, W), ignoring aspect ratio (official ``vit_jax`` eval and Hugging
  Face's ViT image processor);
- ``"crop"``: resize the shorter side to size / crop_pct, then centre-crop (timm, DeiT).
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vitkit.errors import DataError

INCEPTION_MEAN = (0.5, 0.5, 0.5)  # official ViT: inputs scaled to [-1, 1]
INCEPTION_STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


@dataclass(frozen=True)
class Preprocess:
    """How to turn an image file into the model's input tensor."""

    image_size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = INCEPTION_MEAN
    std: tuple[float, float, float] = INCEPTION_STD
    resize: str = "squash"  # "squash" or "crop"
    crop_pct: float = 1.0
    interpolation: str = "bilinear"
    grayscale: bool = False  # single-channel models (e.g. the bundled digits) read images as "L"

    def __post_init__(self) -> None:
        size = self.image_size
        size = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        object.__setattr__(self, "image_size", size)
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if self.resize not in ("squash", "crop"):
            raise ValueError(f"resize must be 'squash' or 'crop', got {self.resize!r}")
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

    def resized(self, img: Image.Image) -> Image.Image:
        """``img`` at ``image_size``: squashed, or shorter side scaled then centre-cropped."""
        H, W = self.image_size
        resample = RESAMPLE[self.interpolation]
        if img.size == (W, H) and (self.resize == "squash" or self.crop_pct == 1.0):
            return img  # resizing to the same size is the identity
        if self.resize == "squash":
            return img.resize((W, H), resample)
        # shorter side to size / crop_pct, then centre crop (H, W)
        scale = max(H / img.height, W / img.width) / self.crop_pct
        new_w, new_h = max(W, round(img.width * scale)), max(H, round(img.height * scale))
        img = img.resize((new_w, new_h), resample)
        left, top = (new_w - W) // 2, (new_h - H) // 2
        return img.crop((left, top, left + W, top + H))

    def to_tensor(self, img: Image.Image) -> torch.Tensor:
        """A decoded image -> normalised float tensor (C, H, W)."""
        mode = "L" if self.grayscale else "RGB"
        img = img if img.mode == mode else img.convert(mode)
        arr = np.asarray(self.resized(img), dtype=np.float32) / 255.0  # (H, W[, C])
        if arr.ndim == 2:
            arr = arr[:, :, None]
        arr = (arr - self._mean) / self._std
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))

    def __call__(self, path_or_image: str | os.PathLike[str] | Image.Image) -> torch.Tensor:
        img = path_or_image if isinstance(path_or_image, Image.Image) else load_image(path_or_image)
        return self.to_tensor(img)


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode an image file fully (so truncation is caught here), any mode, as a PIL image.

    Raises DataError naming the file when it is missing, empty, not an image or truncated.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DataError(f"{p}: no such file")
    if os.path.isdir(p):
        raise DataError(f"{p}: is a directory, not an image")
    if os.path.getsize(p) == 0:
        raise DataError(f"{p}: empty file (0 bytes)")
    try:
        with Image.open(p) as img:
            img.load()
            return img.copy() if img.mode != "P" else img.convert("RGBA")
    except UnidentifiedImageError:
        raise DataError(f"{p}: not a recognised image file") from None
    except Image.DecompressionBombError as e:  # declared size far beyond any real image: refused, not decoded
        raise DataError(f"{p}: image too large to decode ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError, ZeroDivisionError,
            struct.error) as e:  # what Pillow's decoders raise on corrupt data  # fmt: skip
        raise DataError(f"{p}: corrupt or truncated image ({type(e).__name__}: {e})") from None
