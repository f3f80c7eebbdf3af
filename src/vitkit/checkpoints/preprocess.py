"""A checkpoint's evaluation-time preprocessing: decode an image file, resize, normalise. Pillow and numpy only.

A checkpoint carries its :class:`Preprocess`, so ``predict`` and ``eval`` feed a model exactly what it
was trained on. Two resize modes cover the common conventions:

- ``"squash"``: resize straight to (H, W), ignoring aspect ratio (official ``vit_jax`` eval and Hugging
  Face's ViT image processor);
- ``"crop"``: resize the shorter side to size / crop_pct, then centre-crop (timm, DeiT).
"""

from __future__ import annotations

import io
import os
import struct
import warnings
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from PIL.JpegImagePlugin import JpegImageFile

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
        img = convert_image(img, "L" if self.grayscale else "RGB")
        return normalize(np.asarray(self.resized(img)), self._mean, self._std)

    def __call__(self, path_or_image: str | os.PathLike[str] | Image.Image) -> torch.Tensor:
        img = path_or_image if isinstance(path_or_image, Image.Image) else load_image(path_or_image)
        return self.to_tensor(img)


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


def _check_file(p: str) -> None:
    if not os.path.exists(p):
        raise DataError(f"{p}: no such file")
    if os.path.isdir(p):
        raise DataError(f"{p}: is a directory, not an image")
    if os.path.getsize(p) == 0:
        raise DataError(f"{p}: empty file (0 bytes)")


def open_lazy(path: str | os.PathLike[str]) -> Image.Image:
    """A JPEG file opened but not decoded (only its header read), so that a crop can be decoded at reduced
    scale (:func:`decode_crop`); any other image decoded as :func:`load_image` does."""
    p = os.fspath(path)
    _check_file(p)
    try:
        img = Image.open(p)
    except UnidentifiedImageError:
        raise DataError(f"{p}: not a recognised image file") from None
    except Image.DecompressionBombError as e:  # as load_image: refused before any pixel memory
        raise DataError(f"{p}: image too large to decode ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError, ZeroDivisionError,
            struct.error) as e:  # what Pillow's decoders raise on corrupt data  # fmt: skip
        raise DataError(f"{p}: corrupt or truncated image ({type(e).__name__}: {e})") from None
    limit = max_image_pixels()
    if limit is not None and img.width * img.height > limit:  # the same limit as decode_image, from the header
        img.close()
        raise ImageTooLarge(
            f"{p}: image of {img.width}x{img.height} = {img.width * img.height} pixels exceeds the limit of "
            f"{limit} pixels (a decompression bomb or a corrupt header)"
        )
    if isinstance(img, JpegImageFile) and img.mode in ("RGB", "L") and len(img.tile) == 1:
        return img
    img.close()
    return load_image(p)


def is_lazy_jpeg(img: Image.Image) -> bool:
    """True for an image from :func:`open_lazy` that is still undecoded."""
    return isinstance(img, JpegImageFile) and not img.decoderconfig and len(img.tile) == 1  # load() empties tile


def decode_crop(
    img: Image.Image, box: tuple[int, int, int, int], size: tuple[int, int]
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Decode a lazy JPEG for a crop ``box`` (left, top, right, bottom, full-resolution pixels) that will
    be resized to ``size`` = (H, W): at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, ``Image.draft``)
    when the crop keeps at least ``size`` pixels at that scale. Returns the decoded image and the same
    region in its pixels (reduced pixel i covers full-resolution pixels [i s, (i + 1) s)). An image that is
    already decoded comes back as it is."""
    if not is_lazy_jpeg(img):
        return img, (float(box[0]), float(box[1]), float(box[2]), float(box[3]))
    W, H = img.size
    scale = draft_scale(box, size)
    try:
        if scale > 1:
            img.draft(img.mode, (W // scale, H // scale))  # Pillow picks 1/scale: W // (W // s) == s
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError, ZeroDivisionError,
            struct.error) as e:  # what Pillow's decoders raise on corrupt data  # fmt: skip
        img.close()
        raise DataError(f"{getattr(img, 'filename', '') or 'JPEG'}: corrupt or truncated image ({e})") from None
    return img, (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)


def draft_scale(box: tuple[int, int, int, int], size: tuple[int, int]) -> int:
    """The largest of 8, 4, 2 (else 1) by which the crop ``box`` can shrink and still hold ``size`` = (H, W)."""
    cw, ch = box[2] - box[0], box[3] - box[1]
    return next((s for s in (8, 4, 2) if cw >= s * size[1] and ch >= s * size[0]), 1)


def decode_crop_rgb(
    img: Image.Image, box: tuple[int, int, int, int], size: tuple[int, int]
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """:func:`decode_crop` for an RGB model, as an (h, w, 3) uint8 array: a lazy JPEG is decoded by
    libjpeg-turbo through simplejpeg straight into the array (the same pixels as Pillow's decode -- same
    library, same default IDCT and upsampling -- without Pillow's copy out of its image memory); other
    images through :func:`decode_crop`."""
    if not is_lazy_jpeg(img):
        img, region = decode_crop(img, box, size)
        return np.asarray(convert_image(img, "RGB")), region
    import simplejpeg

    W, H = img.size
    scale = draft_scale(box, size)
    name = getattr(img, "filename", "") or "JPEG"
    try:
        with open(name, "rb") as f:
            data = f.read()
        arr = simplejpeg.decode_jpeg(
            data, "RGB", min_height=-(-H // scale), min_width=-(-W // scale), min_factor=scale, strict=True
        )
    except (OSError, ValueError) as e:
        raise DataError(f"{name}: corrupt or truncated image ({e})") from None
    finally:
        img.close()
    if arr.shape[:2] != (-(-H // scale), -(-W // scale)):  # libjpeg scales by 1/s exactly; never silently
        raise DataError(f"{name}: decoded to {arr.shape[1]}x{arr.shape[0]}, expected {W}x{H} / {scale}")
    return arr, (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode an image file fully (so truncation is caught here), any mode, as a PIL image.

    Raises DataError naming the file when it is missing, empty, not an image, truncated, or declares more
    pixels than :func:`max_image_pixels` allows (checked from the header, before any pixel is decoded).
    """
    p = os.fspath(path)
    _check_file(p)
    return decode_image(p, p)


class ImageTooLarge(DataError):
    """An image whose header declares more pixels than the decoder's limit (a decompression bomb)."""


def decode_image(
    source: str | os.PathLike[str] | bytes, name: str, *, max_pixels: int | Literal["default"] | None = "default"
) -> Image.Image:
    """The one decoder of every command (datasets, shards, predict, analyze, serve): a file path or the encoded
    bytes -> a fully decoded PIL image (palette images as RGBA). ``name`` identifies it in errors.

    Anything Pillow rejects -- unknown format, truncation, a header declaring more than ``max_pixels`` pixels
    (default :func:`max_image_pixels`; checked before any pixel is decoded), a decoder failure on malformed
    bytes -- becomes one DataError naming the item (:class:`ImageTooLarge` for too many pixels), so
    ``skip_bad`` can count and drop it like any other bad file.
    """
    if isinstance(source, bytes) and not source:
        raise DataError(f"{name}: empty image data (0 bytes)")
    limit = max_image_pixels() if max_pixels == "default" else max_pixels
    fp: Any = io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the limit is enforced below
            with Image.open(fp) as img:
                w, h = img.size
                if limit is not None and w * h > limit:
                    raise ImageTooLarge(
                        f"{name}: image of {w}x{h} = {w * h} pixels exceeds the limit of {limit} pixels "
                        "(a decompression bomb or a corrupt header)"
                    )
                if w * h == 0:
                    raise DataError(f"{name}: image of {w}x{h} pixels has no pixels")
                img.load()
                return img.copy() if img.mode != "P" else img.convert("RGBA")
    except DataError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own check in open(), at twice its limit
        raise ImageTooLarge(f"{name}: {e}") from None
    except UnidentifiedImageError:
        raise DataError(f"{name}: not a recognised image file") from None
    except MemoryError:
        raise ImageTooLarge(f"{name}: too large to decode in memory") from None
    except Exception as e:
        raise DataError(f"{name}: corrupt or truncated image ({type(e).__name__}: {e})") from None


def max_image_pixels() -> int | None:
    """Largest pixel count decoded: Pillow's ``Image.MAX_IMAGE_PIXELS`` (the ecosystem's knob; None = no
    limit). Pillow itself only warns between this and twice it; vitkit refuses everything above it."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else int(limit)


def convert_image(img: Image.Image, mode: str) -> Image.Image:
    """Any decoded image -> ``mode`` ("RGB" or "L"), the conversion every command uses.

    16-bit greyscale is rescaled to 8 bits (65535 -> 255), not clipped as Pillow's ``convert`` does (which
    would saturate nearly every pixel); 32-bit integer and float greyscale are scaled by their maximum.
    """
    if img.mode == mode:
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        peak = float(np.nanmax(arr)) if arr.size and not np.isnan(arr).all() else 1.0
        hi = 65535.0 if img.mode.startswith("I;16") else max(peak, 1.0)
        arr = np.nan_to_num(arr, nan=0.0)
        img = Image.fromarray(np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8))
        if img.mode == mode:
            return img
    return img.convert(mode)
