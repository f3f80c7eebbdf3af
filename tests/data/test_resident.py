"""The device-resident training loader (data/resident.py) against the host path it replaces: the same batches,
bit for bit, and the cases it must leave to the host loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitkit.data.datasets import open_dataset
from vitkit.data.image_dataset import ArrayDataset
from vitkit.data.loader import TrainLoader
from vitkit.data.resident import ResidentTrainLoader, prefetches, resident_loader
from vitkit.data.transforms import RandAugment, TrainTransform, sample_rng

CPU = torch.device("cpu")


def _digits_transform(**changes: object) -> TrainTransform:
    kw: dict = dict(image_size=(16, 16), crop="inception", crop_scale=(0.7, 1.0), flip=False, grayscale=True)
    kw.update(changes)
    return TrainTransform(**kw)


def _host(ds: ArrayDataset, t: TrainTransform, seed: int, epoch: int, indices: np.ndarray) -> torch.Tensor:
    return torch.stack([t(ds.lazy_item(int(i))[0], sample_rng(seed, epoch, int(i))) for i in indices])


def test_digits_augmentation_equals_the_host_transform_bit_for_bit() -> None:
    """The default job's transform (inception crop of the 8x8 digits to 16x16, Pillow's bilinear) over every
    training image in two epochs: Pillow's integer resampling reproduced in batched float64 products."""
    ds = open_dataset("digits", "train")
    t = _digits_transform()
    loader = resident_loader(ds, t, device=CPU, global_batch=128, seed=3)
    assert isinstance(loader, ResidentTrainLoader)
    for epoch in (0, 5):
        idx = np.arange(len(ds))
        got = loader.augment(epoch, idx)
        want = _host(ds, t, 3, epoch, idx)
        assert got.dtype == want.dtype and got.shape == want.shape == (len(ds), 1, 16, 16)
        assert torch.equal(got, want)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_random_images_with_flips_and_downscaled_rows_equal_the_host(interpolation: str) -> None:
    """Random pixels (every value, not just digit strokes), flips drawn, bicubic's negative lobes, and images
    taller than the input (crops shrink rows -- a wider filter -- while columns are enlarged)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(64, 40, 11), dtype=np.uint8)
    ds = ArrayDataset("random", "train", images, rng.integers(0, 3, 64), ["a", "b", "c"])
    t = _digits_transform(crop_scale=(0.05, 1.0), flip=True, interpolation=interpolation)
    loader = resident_loader(ds, t, device=CPU, global_batch=16, seed=11)
    assert loader is not None
    idx = np.arange(64)
    _, flips = loader.draws(2, idx)
    assert 0 < flips.sum() < 64  # both kinds drawn
    assert torch.equal(loader.augment(2, idx), _host(ds, t, 11, 2, idx))


@pytest.mark.parametrize("prefetch", [False, True])
def test_batches_order_and_resumption_equal_the_host_loader(prefetch: bool) -> None:
    """Rank 1 of 2 with 2 accumulation steps, from step 3 of epoch 4 (a resumed run): the same micro-batches --
    images, labels and indices -- as TrainLoader's; with the host's share computed ahead on a thread (as on a GPU)
    or in turn (as on a CPU)."""
    ds = open_dataset("digits", "train")
    t = _digits_transform(flip=True)
    kw = dict(global_batch=64, seed=7, accum_steps=2, rank=1, world=2)
    host = TrainLoader(ds, t, **kw)  # type: ignore[arg-type]
    dev = resident_loader(ds, t, device=CPU, prefetch=prefetch, **kw)  # type: ignore[arg-type]
    assert dev is not None and (dev._pool is not None) == prefetch
    assert dev is not None and dev.steps_per_epoch == host.steps_per_epoch
    n = 0
    for a, b in zip(host.epoch(4, 3), dev.epoch(4, 3), strict=True):
        assert len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.indices, y.indices) and torch.equal(x.labels, y.labels)
            assert torch.equal(x.images, y.images)
        n += 1
    assert n == host.steps_per_epoch - 3


def test_the_host_loader_keeps_what_the_resident_one_does_not_compute() -> None:
    """RGB models, RandAugment, other crops, and images larger than the input both ways (crops that PyTorch's
    kernel downscales on the host) stay on TrainLoader."""
    ds = open_dataset("digits", "train")
    kw = dict(device=CPU, global_batch=32, seed=0)
    assert resident_loader(ds, _digits_transform(grayscale=False), **kw) is None  # type: ignore[arg-type]
    assert resident_loader(ds, _digits_transform(randaug=RandAugment(1, 5.0)), **kw) is None  # type: ignore[arg-type]
    assert resident_loader(ds, _digits_transform(crop="pad", pad=2), **kw) is None  # type: ignore[arg-type]
    assert resident_loader(ds, _digits_transform(image_size=(4, 4)), **kw) is None  # type: ignore[arg-type]
    assert resident_loader(ds, _digits_transform(image_size=(4, 8)), **kw) is not None  # type: ignore[arg-type]


def test_the_host_share_is_prefetched_on_accelerators_only() -> None:
    """The decision alone (no CUDA here): a thread ahead of a GPU's steps, none beside a CPU's."""
    assert prefetches(torch.device("cuda")) and prefetches(torch.device("cuda:1"))
    assert not prefetches(CPU)
    ds = open_dataset("digits", "train")
    loader = resident_loader(ds, _digits_transform(), device=CPU, global_batch=128, seed=0)
    assert loader is not None and loader._pool is None
