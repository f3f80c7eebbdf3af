"""A small training set held on the device, augmented there in batched tensor ops: the default digits job
without a per-image Python step (issue 31, section 3: on a GPU that job was bound by the loader, 45 ms a step).

:class:`ResidentTrainLoader` yields the same micro-batches as :class:`~vitkit.data.loader.TrainLoader`, bit for
bit, for the case it takes (:func:`resident_loader` says which): an in-memory array data set of one image size,
a greyscale model, the random-resized ("inception") crop without RandAugment, bilinear or bicubic, and images
no larger than the model's input in a dimension. There :meth:`TrainTransform._crop_flip_normalise` resizes every
crop with Pillow, and so does this module, as Pillow computes it: the same per-sample draws (the crop box and the
flip from ``sample_rng(seed, epoch, index)``, on the host, as before), Pillow's integer filter coefficients
(``precompute_coeffs`` and ``normalize_coeffs_8bpc`` of its ``Resample.c``, 22 fractional bits), and its two
passes (horizontal, then vertical, each rounded and clipped to uint8), as two batched matrix products in float64
-- exact, as every product and sum is an integer below 2^53. Flipping and normalisation are the same float32
operations as the host's. Order, resumption and ranks are :class:`TrainLoader`'s own (it is a subclass). On a
GPU, the host's share (the draws and coefficients, ~2.5 ms a step of 128) is computed a few micro-batches ahead on
a thread, while the main thread launches the steps.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.data.image_dataset import ArrayDataset, ImageDataset
from vitkit.data.loader import Batch, TrainLoader, eval_batches
from vitkit.data.transforms import _SUPPORT, TrainTransform, inception_crop_box, sample_rng
from vitkit.images import convert_image

PRECISION_BITS = 22  # Pillow's fixed point for 8-bit resampling: 32 - 8 - 2
LOOKAHEAD = 8  # micro-batches whose host share a prefetching loader computes ahead
RESIDENT_MAX_BYTES = 256 << 20  # the most source pixels (uint8) a data set may have to be held on the device


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5  # Pillow's
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


_FILTERS = {"bilinear": _bilinear, "bicubic": _bicubic}


def pillow_weights(
    in_size: int, lo: np.ndarray, hi: np.ndarray, out_size: int, interpolation: str, offset: np.ndarray, size: int
) -> np.ndarray:
    """Pillow's integer coefficients of one resampling pass, per sample, as dense matrices (n, out_size, size):
    output pixel j of sample s is ``sum_i W[s, j, i] * pixel[i]`` before rounding. ``lo``, ``hi``: each sample's
    box edges in the coordinates of the part of the image Pillow is handed (``pillow_resize``'s, of
    ``in_size`` pixels); ``offset``: where that part starts in the whole image (``size`` pixels). Vectorised
    over samples and output pixels; the same operations, in the same order, as Pillow's C."""
    filt, support0 = _FILTERS[interpolation], _SUPPORT[interpolation]
    n = lo.shape[0]
    lo, hi = lo.astype(np.float64)[:, None], hi.astype(np.float64)[:, None]  # (n, 1)
    scale = (hi - lo) / out_size
    filterscale = np.maximum(scale, 1.0)
    support = support0 * filterscale
    ksize = math.ceil(float(support.max(initial=support0))) * 2 + 1
    center = lo + (np.arange(out_size, dtype=np.float64)[None, :] + 0.5) * scale  # (n, out)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0.0).astype(np.int64)  # C's (int): toward zero
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    ss = 1.0 / filterscale
    taps = np.arange(ksize)[None, None, :]  # (1, 1, k)
    valid = taps < xmax[:, :, None]
    k = np.where(valid, filt((taps + xmin[:, :, None] - center[:, :, None] + 0.5) * ss[:, :, None]), 0.0)
    ww = np.zeros_like(center)
    for t in range(ksize):  # Pillow's running sum, in its order
        ww = ww + k[:, :, t]
    k = np.where(ww[:, :, None] != 0.0, k / np.where(ww == 0.0, 1.0, ww)[:, :, None], k)
    one = float(1 << PRECISION_BITS)
    ints = np.trunc(np.where(k < 0, -0.5 + k * one, 0.5 + k * one)).astype(np.int64)
    out = np.zeros((n, out_size, size), dtype=np.int64)
    cols = offset.astype(np.int64)[:, None, None] + xmin[:, :, None] + taps  # (n, out, k)
    s_idx = np.broadcast_to(np.arange(n)[:, None, None], cols.shape)
    j_idx = np.broadcast_to(np.arange(out_size)[None, :, None], cols.shape)
    out[s_idx[valid], j_idx[valid], cols[valid]] = ints[valid]
    return out


def _clip8(acc: torch.Tensor) -> torch.Tensor:
    """Pillow's ``clip8`` of accumulators that started at 2^(PRECISION_BITS-1): floor(acc / 2^22) in [0, 255]."""
    return torch.floor(acc * (1.0 / (1 << PRECISION_BITS))).clamp_(0.0, 255.0)


def prefetches(device: torch.device) -> bool:
    """Whether a resident loader computes its host share ahead on a thread by default: on an accelerator, whose
    steps leave the host waiting; not on a CPU, whose cores compute the steps themselves."""
    return device.type != "cpu"


class ResidentTrainLoader(TrainLoader):
    """:class:`TrainLoader` for a small greyscale data set held on ``device`` (see the module)."""

    def __init__(
        self,
        dataset: ImageDataset,
        transform: TrainTransform,
        *,
        device: torch.device,
        prefetch: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``prefetch``: compute the host's share (the draws and coefficients) on a thread ahead of the steps;
        None: on a GPU (whose steps leave the host waiting), not on a CPU (whose cores compute the steps)."""
        super().__init__(dataset, transform, **kwargs)
        self.transform, self.device = transform, device
        on = prefetches(device) if prefetch is None else prefetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vitkit-augment") if on else None
        pixels = np.stack([np.asarray(convert_image(dataset[i][0], "L")) for i in range(len(dataset))])
        self.height, self.width = int(pixels.shape[1]), int(pixels.shape[2])
        self.pixels = torch.from_numpy(pixels).to(device=device, dtype=torch.float64)  # (N, h, w)
        self.labels = torch.from_numpy(np.asarray(dataset.labels, dtype=np.int64)).to(device)
        norm = transform._norm
        self._mean = torch.from_numpy(norm._mean).view(-1, 1, 1).to(device)
        self._std = torch.from_numpy(norm._std).view(-1, 1, 1).to(device)

    def draws(self, epoch: int, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The crop boxes (n, 4: left, top, right, bottom) and flips (n,) of ``indices`` in ``epoch``: the host
        path's draws, in its order (box, then flip)."""
        t = self.transform
        boxes = np.empty((len(indices), 4), dtype=np.int64)
        flips = np.zeros(len(indices), dtype=bool)
        for j, i in enumerate(indices):
            rng = sample_rng(self.seed, epoch, int(i))
            boxes[j] = inception_crop_box(self.width, self.height, rng, t.crop_scale, t.crop_ratio)
            flips[j] = t.flip and rng.random() < 0.5
        return boxes, flips

    def plan(self, epoch: int, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host's share of augmenting ``indices`` in ``epoch``: Pillow's coefficients of the horizontal
        (n, W, w) and vertical (n, H, h) passes, and the flips (n,)."""
        H, W = self.transform._norm.image_size
        boxes, flips = self.draws(epoch, indices)
        wh = self._pass_weights(boxes[:, 0], boxes[:, 2], self.width, W)
        wv = self._pass_weights(boxes[:, 1], boxes[:, 3], self.height, H)
        return wh, wv, flips

    def augment(self, epoch: int, indices: np.ndarray) -> torch.Tensor:
        """The training transform of ``indices`` in ``epoch``, as (n, 1, H, W) float32 on the device."""
        return self._apply(indices, self.plan(epoch, indices))[0]

    def _apply(
        self, indices: np.ndarray, plan: tuple[np.ndarray, np.ndarray, np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(augmented images, labels) on the device: the plan and the indices travel in one copy."""
        wh, wv, flips = plan
        n = len(indices)
        packed = np.concatenate(
            [np.asarray(indices, dtype=np.float64), flips.astype(np.float64), wh.ravel(), wv.ravel()]
        )
        dev = torch.from_numpy(packed).to(self.device, non_blocking=True)
        idx = dev[:n].long()
        flip = dev[n : 2 * n].bool().view(-1, 1, 1)
        twh = dev[2 * n : 2 * n + wh.size].view(wh.shape)
        twv = dev[2 * n + wh.size :].view(wv.shape)
        src = self.pixels.index_select(0, idx)  # (n, h, w)
        half = float(1 << (PRECISION_BITS - 1))
        rows = _clip8(torch.bmm(src, twh.transpose(1, 2)) + half)  # horizontal pass: (n, h, W)
        out = _clip8(torch.bmm(twv, rows) + half)  # vertical pass: (n, H, W)
        if flips.any():
            out = torch.where(flip, out.flip(-1), out)
        x = out.to(torch.float32)[:, None]  # (n, 1, H, W): whole numbers 0..255, exact in float32
        return x.div_(255.0).sub_(self._mean).div_(self._std), self.labels.index_select(0, idx)

    def _pass_weights(self, lo: np.ndarray, hi: np.ndarray, size: int, out_size: int) -> np.ndarray:
        """Pillow's coefficients for one pass over boxes [lo, hi) of a dimension of ``size`` pixels, computed on
        the part of the image ``pillow_resize`` hands to Pillow (the same numbers as on the whole image)."""
        support = _SUPPORT[self.transform.interpolation]
        reach = np.ceil(support * np.maximum((hi - lo) / out_size, 1.0)).astype(np.int64) + 2
        start = np.maximum(lo - reach, 0)
        stop = np.minimum(hi + reach, size)
        mats = np.zeros((len(lo), out_size, size), dtype=np.int64)
        for part in np.unique(stop - start):  # Pillow's pass depends on the part's size: one call per size
            sel = np.flatnonzero(stop - start == part)
            mats[sel] = pillow_weights(int(part), lo[sel] - start[sel], hi[sel] - start[sel], out_size,
                                       self.transform.interpolation, start[sel], size)  # fmt: skip
        return mats.astype(np.float64)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
        order = self.order(epoch)
        micros = [m for step in range(start_step, self.steps_per_epoch) for m in self.step_indices(order, step)]
        plans = self._plans(epoch, micros)
        for s in range(0, len(micros), self.accum_steps):
            group = []
            for micro in micros[s : s + self.accum_steps]:
                images, labels = self._apply(micro, next(plans))
                group.append(Batch(images, labels, torch.from_numpy(np.asarray(micro, dtype=np.int64))))
            yield group

    def _plans(self, epoch: int, micros: list[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`plan` of each micro-batch in turn; with ``prefetch``, computed ``LOOKAHEAD`` micro-batches ahead
        on a thread (numpy's draws and PyTorch's kernel launches release the GIL in turn), else when asked."""
        if self._pool is None:
            for micro in micros:
                yield self.plan(epoch, micro)
            return
        rest = iter(micros)
        ahead = deque(self._pool.submit(self.plan, epoch, m) for m in itertools.islice(rest, LOOKAHEAD))
        while ahead:
            done = ahead.popleft()
            nxt = next(rest, None)
            if nxt is not None:
                ahead.append(self._pool.submit(self.plan, epoch, nxt))
            yield done.result()


def resident_loader(
    dataset: ImageDataset, transform: TrainTransform, *, device: torch.device, **kwargs: Any
) -> ResidentTrainLoader | None:
    """A :class:`ResidentTrainLoader` where it computes what :class:`TrainLoader` does (see the module), else
    None: an :class:`ArrayDataset` of one image size of at most ``RESIDENT_MAX_BYTES`` pixels, no larger than
    the model's input in one dimension at least, and a transform that is a greyscale inception crop (bilinear or
    bicubic) without RandAugment."""
    t = transform
    if not isinstance(dataset, ArrayDataset) or not isinstance(t, TrainTransform) or len(dataset) == 0:
        return None
    if t.crop != "inception" or t.randaug is not None or not t.grayscale or t.interpolation not in _FILTERS:
        return None
    shape = dataset.images.shape
    H, W = t._norm.image_size
    if shape[0] * shape[1] * shape[2] > RESIDENT_MAX_BYTES or (shape[1] > H and shape[2] > W):
        return None  # larger than the input both ways: crops may be downscaled, by PyTorch's kernel on the host
    return ResidentTrainLoader(dataset, transform, device=device, **kwargs)


def resident_eval_batches(
    dataset: ImageDataset,
    transform: Callable[[Image.Image], torch.Tensor],
    batch_size: int,
    *,
    rank: int = 0,
    world: int = 1,
    device: torch.device,
) -> list[Batch] | None:
    """``eval_batches`` of a small in-memory data set (an :class:`ArrayDataset` whose transformed images take at
    most ``RESIDENT_MAX_BYTES``), all of them, on ``device``: a training run evaluates the same tensors after
    every epoch, and keeps these. None for any other data set."""
    if not isinstance(dataset, ArrayDataset) or len(dataset) == 0:
        return None
    first = transform(dataset[0][0])
    if first.numel() * first.element_size() * len(dataset) > RESIDENT_MAX_BYTES:
        return None
    out = []
    for b in eval_batches(dataset, transform, batch_size, rank=rank, world=world):
        valid = None if b.valid is None else b.valid.to(device)
        out.append(Batch(b.images.to(device), b.labels.to(device), b.indices, valid))
    return out
