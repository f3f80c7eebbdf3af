"""The checkpoint's evaluation preprocessing for the batch jobs, on images that may still be encoded.

:class:`EvalTransform` turns an image from a job's input into the model's input tensor (C, H, W):

- ``reference=True``: exactly :meth:`Preprocess.to_tensor` of the fully decoded image (Pillow's decode and
  resize), bit for bit what ``vitkit predict`` and ``vitkit eval`` computed before the fast path became their
  default; ``--precision fp32`` uses it;
- otherwise a JPEG read but not decoded (:class:`~vitkit.images.EncodedJpeg`) is decoded by
  libjpeg-turbo straight into an array, at 1/2, 1/4 or 1/8 scale (DCT scaling, what Pillow's ``draft`` does)
  when the reduced image still holds ``REDUCED_MARGIN`` times the pixels the resize needs in each direction,
  and resized by PyTorch's antialiased uint8 kernel (Pillow's filter; the same pixels within rounding, 3x
  faster), or by Pillow when the image covers a fractional region of the reduced decode. The result is the
  reference's pixels within resampling error: tests/data/test_eval_transform.py bounds it on photos against
  the full decode, below the difference between Pillow's bilinear and bicubic filters on the same image.
  Other images (PNG, CMYK JPEGs, greyscale models, interpolations PyTorch has no antialiased kernel for)
  take the reference path.

With ``uint8=True`` either path stops before normalisation and returns the pixels, (C, H, W) uint8: a batch job
hands a batch of them to the engine (a quarter of the bytes through shared memory and to the device), and
:class:`Normalizer` computes on the device the float values the worker would have computed, bit for bit
(the same float32 operations in the same order: tests/data/test_eval_transform.py checks every uint8 value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vitkit.checkpoints.preprocess import RESAMPLE, TORCH_RESIZE, Preprocess
from vitkit.images import EncodedJpeg, LazyImage, convert_image, decode_image, decode_scaled

# A JPEG is decoded at 1/s scale only when the reduced image keeps this many times the resize's output pixels
# in each direction, so the final resize still low-passes what DCT scaling leaves. Measured on tiles of the
# scikit-learn photos against the full decode (224 px, bilinear): margin 2.2-2.9 mean error 0.3-0.4 levels
# (p99 2-3); 1.4-1.6: 0.8-0.9 (p99 5-6); 1.0-1.1: 1.4-1.6 (p99 11-12, max 25-29), as large as the difference
# between Pillow's bilinear and bicubic resize of the same image (1.6, p99 11, max 22).
REDUCED_MARGIN = 1.5
# A centre crop whose resized image would hold more than this many times the crop's pixels (an image far from
# the crop's shape: 1000x1 -> 256000x256 for a 224 crop) resizes only the crop's box, as the reference does
MAX_CROP_AMPLIFICATION = 4


def reduced_scale(width: int, height: int, pre: Preprocess) -> int:
    """The largest of 8, 4, 2 by which a ``width`` x ``height`` JPEG may be decoded for ``pre`` (the reduced
    image keeps ``REDUCED_MARGIN`` times the resize's output in each direction), else 1."""
    new_w, new_h, _, _ = pre.resize_target(width, height)
    return next(
        (s for s in (8, 4, 2) if width / s >= REDUCED_MARGIN * new_w and height / s >= REDUCED_MARGIN * new_h), 1
    )


@dataclass(frozen=True)
class EvalTransform:
    """A job's image (decoded, or a JPEG read and not decoded) -> the model's input (C, H, W) by the
    checkpoint's preprocessing; see the module docstring for the two paths. Picklable: it runs in the
    decoding worker processes."""

    preprocess: Preprocess
    reference: bool = False
    uint8: bool = False  # the pixels before normalisation, (C, H, W) uint8; a Normalizer finishes them

    @property
    def lazy(self) -> bool:
        """Whether it wants JPEGs read and not decoded (the fast path); the reference decodes them fully."""
        return not self.reference

    def __call__(self, img: LazyImage, name: str = "image") -> torch.Tensor:
        """``name`` identifies a decoded image in errors (a JPEG read and not decoded carries its own)."""
        pre = self.preprocess
        if isinstance(img, EncodedJpeg):
            pre.check_size(img.width, img.height, img.name)  # refused from the header, before any decoding
            if self.reference or pre.grayscale or img.mode != "RGB" or pre.interpolation not in TORCH_RESIZE:
                name = img.name
                img = decode_image(img.data, name)
            else:
                return self._jpeg(img)
        if self.uint8:
            return pixels(pre, img, name)
        return pre.to_tensor(img, name)

    def _jpeg(self, jpeg: EncodedJpeg) -> torch.Tensor:
        pre = self.preprocess
        new_w, new_h, left, top = pre.resize_target(jpeg.width, jpeg.height)
        s = reduced_scale(jpeg.width, jpeg.height, pre)
        arr = decode_scaled(jpeg, s)  # (ceil(height / s), ceil(width / s), 3) uint8
        H, W = pre.image_size
        if pre.resize != "squash" and new_w * new_h > MAX_CROP_AMPLIFICATION * H * W:  # a line of pixels: resize
            # only the crop's box (Pillow maps it as the whole resize would), never the 256000x256 intermediate
            x0, y0, x1, y1 = pre.crop_box(jpeg.width, jpeg.height, jpeg.name)
            box = (x0 / s, y0 / s, x1 / s, y1 / s)
            out = Image.fromarray(arr).resize((W, H), RESAMPLE[pre.interpolation], box=box)
            x = torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)  # (3, H, W) uint8
            return self._normalise(x)
        if jpeg.width % s or jpeg.height % s:  # the image covers a fractional region of the reduced decode: Pillow
            # resizes exactly that region (the whole last row or column instead moves every sample, by up to
            # half a reduced pixel: 3x the error on sharp edges, measured)
            region = (0.0, 0.0, jpeg.width / s, jpeg.height / s)
            resized = Image.fromarray(arr).resize((new_w, new_h), RESAMPLE[pre.interpolation], box=region)
            x = torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1)  # (3, new_h, new_w) uint8
        else:
            x = torch.from_numpy(arr).permute(2, 0, 1)  # (3, h, w) uint8
            if arr.shape[:2] != (new_h, new_w):
                mode = TORCH_RESIZE[pre.interpolation]
                x = F.interpolate(x[None], size=(new_h, new_w), mode=mode, antialias=True)[0]
        return self._normalise(x[:, top : top + H, left : left + W])  # (3, H, W) uint8

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels (3, H, W) uint8 as the job takes them: as they are with ``uint8`` (normalised on its device),
        else normalised here, float32."""
        if self.uint8:
            return x
        pre = self.preprocess
        mean = torch.tensor(pre.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(pre.std, dtype=torch.float32).view(3, 1, 1)
        return x.float().div_(255.0).sub_(mean).div_(std).contiguous()


def pixels(pre: Preprocess, img: Image.Image, name: str = "image") -> torch.Tensor:
    """A decoded image -> the pixels :meth:`Preprocess.to_tensor` normalises, (C, H, W) uint8: the same size
    check, mode conversion and resize."""
    pre.check_size(img.width, img.height, name)
    img = convert_image(img, "L" if pre.grayscale else "RGB")
    arr = np.array(pre.resized(img, name))  # a writable copy (Pillow's buffer is read-only)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1)  # (C, H, W) uint8


class Normalizer:
    """uint8 pixels (B, C, H, W) on any device -> the model's float32 input on that device: ``(x / 255 - mean) /
    std`` per channel, every value bit for bit what :func:`vitkit.checkpoints.preprocess.normalize` computes on
    the CPU (the same three float32 operations in the same order, each correctly rounded). The divisors are
    tensors on the device, not Python numbers: CUDA divides by a Python number as a multiplication by its
    reciprocal, which differs in the last bit for some values. The constants are made once per device."""

    def __init__(self, pre: Preprocess) -> None:
        self.channels = pre.channels
        self.mean, self.std = pre.mean[: self.channels], pre.std[: self.channels]
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        got = self._consts.get(device)
        if got is None:
            shape = (1, self.channels, 1, 1)
            f32 = torch.float32
            got = (
                torch.tensor(255.0, dtype=f32).to(device),
                torch.tensor(self.mean, dtype=f32).view(shape).to(device),
                torch.tensor(self.std, dtype=f32).view(shape).to(device),
            )
            self._consts[device] = got
        return got

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(f"expected uint8 pixels (B, {self.channels}, H, W), got {x.dtype} {tuple(x.shape)}")
        scale, mean, std = self._on(x.device)
        return x.to(torch.float32).div_(scale).sub_(mean).div_(std)
