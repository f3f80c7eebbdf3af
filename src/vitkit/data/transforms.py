"""Training-time augmentation on PIL images, without torchvision. Every random draw comes from a numpy
``Generator`` passed in, so a sample's augmentation is a pure function of (seed, epoch, index).

- :func:`inception_crop`: random area/aspect crop resized to the target ("random-resized crop"), as
  ``tf.image.sample_distorted_bounding_box`` in the official input pipelines (area 5%-100%, aspect 3/4-4/3).
- :func:`pad_crop`: pad and crop back at a random offset (random translation; small images such as CIFAR).
- :func:`hflip`.
- :class:`RandAugment`: the 16 operations of the TensorFlow implementation used by AugReg / big_vision
  (``randaug(2, 15)``...), with its magnitude mapping; TF's absolute pixel constants (translate 100 px,
  cutout 40 px at 224 px) are scaled with the image size.
- :class:`TrainTransform`: crop -> flip -> RandAugment -> normalise to a (C, H, W) float tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from vitkit.checkpoints.preprocess import INCEPTION_MEAN, INCEPTION_STD, RESAMPLE, TORCH_RESIZE, Preprocess
from vitkit.images import LazyImage, convert_image, decode_crop, decode_crop_rgb

Rng = np.random.Generator


def sample_rng(seed: int, epoch: int, index: int) -> Rng:
    """The generator for one sample's augmentation in one epoch (independent of worker, rank and order)."""
    return np.random.default_rng([seed, epoch, index, 0x5A17])


# ------------------------------------------------------------------------------------------------------
# Geometric crops and flips
# ------------------------------------------------------------------------------------------------------


def inception_crop_box(
    width: int,
    height: int,
    rng: Rng,
    scale: tuple[float, float] = (0.05, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a crop covering ``scale`` of the area with aspect ratio in ``ratio``
    (log-uniform). After ``attempts`` misses, the whole image (as TF's ``use_image_if_no_bounding_boxes``)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(attempts):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    return 0, 0, width, height


def inception_crop(
    img: LazyImage,
    size: tuple[int, int],
    rng: Rng,
    scale: tuple[float, float] = (0.05, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    interpolation: str = "bilinear",
    mode: str | None = None,
) -> Image.Image:
    """Random-resized crop to ``size`` = (H, W); given a ``mode`` ("RGB" or "L"), the crop is converted to it
    (:func:`~vitkit.images.convert_image`) before it is resized."""
    box = inception_crop_box(img.width, img.height, rng, scale, ratio)
    img, region = decode_crop(img, box, size)  # a lazy JPEG: decoded at the smallest scale the crop allows
    img = img if mode is None else convert_image(img, mode)
    return img.resize((size[1], size[0]), RESAMPLE[interpolation], box=region)


def pad_crop(
    img: Image.Image, size: tuple[int, int], pad: int, rng: Rng, interpolation: str = "bilinear"
) -> Image.Image:
    """Resize to ``size``, zero-pad by ``pad`` pixels and crop ``size`` back at a random offset."""
    H, W = size
    if img.size != (W, H):
        img = img.resize((W, H), RESAMPLE[interpolation])
    if pad <= 0:
        return img
    dx, dy = int(rng.integers(0, 2 * pad + 1)), int(rng.integers(0, 2 * pad + 1))
    canvas = Image.new(img.mode, (W + 2 * pad, H + 2 * pad))
    canvas.paste(img, (pad, pad))
    return canvas.crop((dx, dy, dx + W, dy + H))


def hflip(img: Image.Image, rng: Rng, p: float = 0.5) -> Image.Image:
    """Mirror the image left-right with probability ``p``."""
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < p else img


# ------------------------------------------------------------------------------------------------------
# RandAugment (Cubuk et al. 2020), the TensorFlow/big_vision variant
# ------------------------------------------------------------------------------------------------------

MAX_LEVEL = 10.0
GRAY = 128  # TF's replace value for pixels uncovered by geometric ops and cutout (``RandAugment.fill``)


def _signed(v: float, rng: Rng) -> float:
    return -v if rng.random() < 0.5 else v


def _affine(img: Image.Image, coeffs: tuple[float, ...], fill: int) -> Image.Image:
    color = (fill,) * len(img.getbands())
    return img.transform(img.size, Image.Transform.AFFINE, coeffs, Image.Resampling.NEAREST, fillcolor=color)


def _solarize_add(img: Image.Image, addition: int, threshold: int = 128) -> Image.Image:
    arr = np.asarray(img).astype(np.int32)
    added = np.clip(arr + addition, 0, 255)
    return Image.fromarray(np.where(arr < threshold, added, arr).astype(np.uint8))


def _cutout(img: Image.Image, pad: int, rng: Rng, fill: int) -> Image.Image:
    W, H = img.size
    cy, cx = int(rng.integers(0, H)), int(rng.integers(0, W))
    arr = np.array(img)
    arr[max(cy - pad, 0) : min(cy + pad, H), max(cx - pad, 0) : min(cx + pad, W)] = fill
    return Image.fromarray(arr)


def _op_table(img_size: int, fill: int = GRAY) -> dict[str, Callable[[Image.Image, float, Rng], Image.Image]]:
    """name -> op(img, level in [0, 10], rng). Level mappings follow TF's ``level_to_arg``."""
    translate_const = 100.0 * img_size / 224.0
    cutout_const = 40.0 * img_size / 224.0

    def enhance(cls: type) -> Callable[[Image.Image, float, Rng], Image.Image]:
        return lambda im, lv, r: cls(im).enhance(lv / MAX_LEVEL * 1.8 + 0.1)

    return {
        "AutoContrast": lambda im, lv, r: ImageOps.autocontrast(im),
        "Equalize": lambda im, lv, r: ImageOps.equalize(im),
        "Invert": lambda im, lv, r: ImageOps.invert(im),
        "Rotate": lambda im, lv, r: im.rotate(
            _signed(lv / MAX_LEVEL * 30.0, r), Image.Resampling.NEAREST, fillcolor=(fill,) * len(im.getbands())
        ),
        # TF: int(level / 10 * 4) bits kept -- level 0 posterizes to black, as the original ("not nothing")
        "Posterize": lambda im, lv, r: _posterize(im, int(lv / MAX_LEVEL * 4)),
        "Solarize": lambda im, lv, r: ImageOps.solarize(im, int(lv / MAX_LEVEL * 256)),
        "SolarizeAdd": lambda im, lv, r: _solarize_add(im, int(lv / MAX_LEVEL * 110)),
        "Color": enhance(ImageEnhance.Color),
        "Contrast": enhance(ImageEnhance.Contrast),
        "Brightness": enhance(ImageEnhance.Brightness),
        "Sharpness": enhance(ImageEnhance.Sharpness),
        "ShearX": lambda im, lv, r: _affine(im, (1, _signed(lv / MAX_LEVEL * 0.3, r), 0, 0, 1, 0), fill),
        "ShearY": lambda im, lv, r: _affine(im, (1, 0, 0, _signed(lv / MAX_LEVEL * 0.3, r), 1, 0), fill),
        "TranslateX": lambda im, lv, r: _affine(
            im, (1, 0, _signed(lv / MAX_LEVEL * translate_const, r), 0, 1, 0), fill
        ),
        "TranslateY": lambda im, lv, r: _affine(
            im, (1, 0, 0, 0, 1, _signed(lv / MAX_LEVEL * translate_const, r)), fill
        ),
        "Cutout": lambda im, lv, r: _cutout(im, int(lv / MAX_LEVEL * cutout_const), r, fill),
    }


def _posterize(img: Image.Image, bits: int) -> Image.Image:
    shift = 8 - bits
    arr = np.asarray(img)
    return Image.fromarray(((arr >> shift) << shift).astype(np.uint8) if shift < 8 else np.zeros_like(arr))


RANDAUGMENT_OPS = tuple(_op_table(224))
# Below this many pixels a JPEG is decoded at full scale even when the crop would allow 1/2: the entropy
# decoding, which DCT scaling does not shorten, dominates there, and a reduced decode's fractional region
# must be resized by Pillow (3x slower than PyTorch's kernel). Measured (benchmarks/input_pipeline.py,
# 224 px): 800x600 JPEGs 1.66 ms per sample at full scale vs 1.77-1.89 reduced; 1200x900 even; 2000x1500
# 7.3 vs 5.8-6.2 ms.
REDUCED_DECODE_PIXELS = 1_200_000
_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}  # Pillow's filter radius (in output pixels when downscaling)


@dataclass(frozen=True)
class RandAugment:
    """``num_layers`` ops drawn uniformly, each applied with a probability drawn from U(0.2, 0.8) (as TF's
    ``distort_image_with_randaugment``), all at ``magnitude`` (0..10; AugReg uses 10, 15, 20). ``ops``
    restricts the choice (e.g. the geometric ones only); ``fill`` paints uncovered pixels (TF: 128)."""

    num_layers: int = 2
    magnitude: float = 10.0
    ops: tuple[str, ...] = RANDAUGMENT_OPS
    fill: int = GRAY

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in RANDAUGMENT_OPS]
        if unknown or not self.ops:
            raise ValueError(f"unknown RandAugment op(s) {unknown}; choose from {', '.join(RANDAUGMENT_OPS)}")

    def __call__(self, img: Image.Image, rng: Rng) -> Image.Image:
        table = _op_table(min(img.size), self.fill)
        for _ in range(self.num_layers):
            name = self.ops[int(rng.integers(0, len(self.ops)))]
            prob = rng.uniform(0.2, 0.8)
            if rng.random() < prob:
                img = table[name](img, self.magnitude, rng)
        return img


# ------------------------------------------------------------------------------------------------------
# The training transform
# ------------------------------------------------------------------------------------------------------


def triple(values: tuple[float, ...] | list[float]) -> tuple[float, float, float]:
    """Per-channel statistics as an RGB triple (one value is repeated)."""
    v = [float(x) for x in values]
    if len(v) == 1:
        v = v * 3
    if len(v) != 3:
        raise ValueError(f"expected 1 or 3 per-channel values, got {len(v)}")
    return (v[0], v[1], v[2])


@dataclass(frozen=True)
class TrainTransform:
    """PIL image -> augmented, normalised (C, H, W) float tensor. ``crop``: "inception" (random-resized),
    "pad" (random translation by up to ``pad`` pixels) or "resize" (no random crop)."""

    image_size: tuple[int, int] = (224, 224)
    crop: str = "inception"
    crop_scale: tuple[float, float] = (0.05, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    pad: int = 0
    flip: bool = True
    randaug: RandAugment | None = None
    mean: tuple[float, ...] = INCEPTION_MEAN
    std: tuple[float, ...] = INCEPTION_STD
    grayscale: bool = False
    interpolation: str = "bilinear"
    _norm: Preprocess = field(init=False, repr=False, compare=False)
    # accepts JPEGs opened but not decoded (ImageDataset.lazy_item) and decodes only the scale it needs
    decodes_lazily: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.crop not in ("inception", "pad", "resize"):
            raise ValueError(f"crop must be 'inception', 'pad' or 'resize', got {self.crop!r}")
        mean, std = triple(self.mean), triple(self.std)
        pre = Preprocess(self.image_size, mean, std, interpolation=self.interpolation, grayscale=self.grayscale)
        object.__setattr__(self, "_norm", pre)

    def augment(self, img: LazyImage, rng: Rng) -> Image.Image:
        """The augmented PIL image (RGB, or L for a greyscale model without RandAugment), before
        normalisation."""
        mode = "L" if self.grayscale and self.randaug is None else "RGB"
        size = self._norm.image_size
        if self.crop == "inception":
            img = inception_crop(img, size, rng, self.crop_scale, self.crop_ratio, self.interpolation, mode)
        else:
            img, _ = decode_crop(img, (0, 0, img.width, img.height), (img.height, img.width))  # full scale
            img = convert_image(img, mode)
            img = pad_crop(img, size, self.pad if self.crop == "pad" else 0, rng, self.interpolation)
        if self.flip:
            img = hflip(img, rng)
        if self.randaug is not None:
            img = self.randaug(img, rng)
        return img

    def __call__(self, img: LazyImage, rng: Rng) -> torch.Tensor:
        if self.crop == "inception" and self.randaug is None and self.interpolation in TORCH_RESIZE:
            return self._crop_flip_normalise(img, rng)
        return self._norm.to_tensor(self.augment(img, rng))  # (C, H, W)

    def _crop_flip_normalise(self, img: LazyImage, rng: Rng) -> torch.Tensor:
        """``to_tensor(augment(img, rng))`` for an inception crop without RandAugment, with the same random
        draws and the same region: a JPEG is decoded straight into an array (at reduced scale when the crop
        allows and the image has at least ``REDUCED_DECODE_PIXELS``, see ``images.decode_crop_rgb``);
        a crop on whole pixels is resized by PyTorch's antialiased uint8 kernel (Pillow's filter, 3x
        faster; the same pixels within rounding, except on the outermost rows and columns, where Pillow's
        filter also reads pixels just outside the box); flipped and normalised in CHW. Crops of a
        reduced-scale decode (a fractional region), and enlargements for a greyscale model (so the bundled
        digits stay bit-identical), are resized by Pillow, given only the pixels its filter reads."""
        size = self._norm.image_size
        box = inception_crop_box(img.width, img.height, rng, self.crop_scale, self.crop_ratio)
        reduce = img.width * img.height >= REDUCED_DECODE_PIXELS  # see the constant
        if self.grayscale:  # Pillow's RGB -> L after the decode, as augment() does
            pil, region = decode_crop(img, box, size, reduce=reduce)
            pixels = np.asarray(convert_image(pil, "L"))
        else:
            pixels, region = decode_crop_rgb(img, box, size, reduce=reduce)
        flip = self.flip and rng.random() < 0.5  # hflip's draw
        left, top, right, bottom = region
        whole = all(float(v).is_integer() for v in region)
        if whole and (not self.grayscale or (right - left > size[1] and bottom - top > size[0])):
            crop = pixels[int(top) : int(bottom), int(left) : int(right)]
            if not crop.flags.writeable:  # Pillow's arrays are read-only; torch wants to own writable memory
                crop = crop.copy()
            x = torch.from_numpy(crop.reshape(crop.shape[0], crop.shape[1], -1)).permute(2, 0, 1)[None]
            out = F.interpolate(x, size=size, mode=TORCH_RESIZE[self.interpolation], antialias=True)[0]
        else:
            out = torch.from_numpy(pillow_resize(pixels, region, size, self.interpolation)).permute(2, 0, 1)
        if flip:
            out = out.flip(-1)
        x = torch.empty(out.shape, dtype=torch.float32).copy_(out)  # (C, H, W): cast and lay out in one pass
        mean, std = self._norm._mean, self._norm._std
        return x.div_(255.0).sub_(torch.from_numpy(mean).view(-1, 1, 1)).div_(torch.from_numpy(std).view(-1, 1, 1))


def pillow_resize(
    pixels: np.ndarray, region: tuple[float, float, float, float], size: tuple[int, int], interpolation: str
) -> np.ndarray:
    """Pillow's ``resize((W, H), box=region)`` of the image ``pixels`` (h, w[, C]) uint8, as (H, W, C), handed
    only the pixels its filter reads around the region (the same result, without copying the whole image
    into Pillow)."""
    H, W = size
    h, w = pixels.shape[:2]
    left, top, right, bottom = region
    support = _SUPPORT[interpolation]
    mx = math.ceil(support * max((right - left) / W, 1.0)) + 2  # Pillow's filter reach, plus rounding
    my = math.ceil(support * max((bottom - top) / H, 1.0)) + 2
    x0, y0 = max(math.floor(left) - mx, 0), max(math.floor(top) - my, 0)
    x1, y1 = min(math.ceil(right) + mx, w), min(math.ceil(bottom) + my, h)
    part = Image.fromarray(np.ascontiguousarray(pixels[y0:y1, x0:x1]))
    out = part.resize((W, H), RESAMPLE[interpolation], box=(left - x0, top - y0, right - x0, bottom - y0))
    return np.array(out).reshape(H, W, -1)  # writable: torch takes it over
