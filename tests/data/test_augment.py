"""Augmentation: crops, flips, RandAugment, Mixup/CutMix, label smoothing, and the deterministic loader."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data.datasets import open_dataset
from vitkit.data.loader import TrainLoader, epoch_order
from vitkit.data.mix import Mixer, one_hot_smooth
from vitkit.data.transforms import (
    RANDAUGMENT_OPS,
    RandAugment,
    TrainTransform,
    _op_table,
    hflip,
    inception_crop_box,
    sample_rng,
)


def _photo(sample_jpeg_path: object) -> Image.Image:
    return Image.open(sample_jpeg_path).convert("RGB").resize((64, 48))  # type: ignore[arg-type]


def test_inception_crop_box_area_and_aspect() -> None:
    rng = np.random.default_rng(0)
    areas, aspects = [], []
    for _ in range(500):
        left, top, right, bottom = inception_crop_box(200, 100, rng, scale=(0.1, 0.6), ratio=(0.5, 2.0))
        assert 0 <= left < right <= 200 and 0 <= top < bottom <= 100
        w, h = right - left, bottom - top
        areas.append(w * h / 20_000)
        aspects.append(w / h)
    assert min(areas) > 0.08 and max(areas) < 0.63  # within the range (up to rounding)
    assert min(aspects) > 0.45 and max(aspects) < 2.2
    assert np.std(areas) > 0.1  # actually random
    # impossible constraints fall back to the whole image
    assert inception_crop_box(10, 10, rng, scale=(1.0, 1.0), ratio=(4.0, 5.0)) == (0, 0, 10, 10)


def test_train_transform_shapes_and_determinism(sample_jpeg: object) -> None:
    img = _photo(sample_jpeg)
    t = TrainTransform((32, 24), randaug=RandAugment(2, 10))
    a, b = t(img, sample_rng(0, 3, 7)), t(img, sample_rng(0, 3, 7))
    assert a.shape == (3, 32, 24) and a.dtype == torch.float32 and a.min() >= -1.0 and a.max() <= 1.0
    assert torch.equal(a, b)  # a pure function of (seed, epoch, index)
    assert not torch.equal(a, t(img, sample_rng(0, 4, 7)))  # another epoch: another augmentation
    gray = TrainTransform((16, 16), crop="pad", pad=2, flip=False, grayscale=True)(img, sample_rng(1, 0, 0))
    assert gray.shape == (1, 16, 16)
    with pytest.raises(ValueError, match="crop must be"):
        TrainTransform(crop="zoom")


def test_flip_probability() -> None:
    img = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4))
    rng = np.random.default_rng(0)
    flips = sum(np.asarray(hflip(img, rng))[0, 0] == 3 for _ in range(1000))
    assert 430 < flips < 570


def test_randaugment_covers_every_op(sample_jpeg: object) -> None:
    """All 16 TF ops exist, keep size and mode, and change the image at magnitude 7 (TF's mapping makes some
    ops no-ops at particular levels: Solarize at 10 has threshold 256, the enhancers at 5 a factor of 1)."""
    assert len(RANDAUGMENT_OPS) == 16
    img = _photo(sample_jpeg)
    rng = np.random.default_rng(0)
    for name, op in _op_table(min(img.size)).items():
        out = op(img, 7.0, rng)
        assert out.size == img.size and out.mode == "RGB", name
        assert not np.array_equal(np.asarray(out), np.asarray(img)), name
    # level 0 is not a no-op for the TF mapping (posterize to 0 bits, solarize at 0), as AugReg's "light1"
    assert not np.asarray(_op_table(64)["Posterize"](img, 0.0, rng)).any()
    # chosen ops follow the op subset; the sequence is seeded
    geo = RandAugment(2, 5, ops=("Rotate",), fill=0)
    assert np.array_equal(np.asarray(geo(img, sample_rng(0, 0, 1))), np.asarray(geo(img, sample_rng(0, 0, 1))))
    with pytest.raises(ValueError, match="unknown RandAugment op"):
        RandAugment(ops=("Zoom",))
    # ops are applied with probability U(0.2, 0.8) each: over many draws, some images pass unchanged
    ra = RandAugment(1, 10)
    unchanged = sum(np.array_equal(np.asarray(ra(img, sample_rng(0, 0, i))), np.asarray(img)) for i in range(200))
    assert 40 < unchanged < 160


def test_label_smoothing_and_mixup_mass() -> None:
    labels = torch.tensor([0, 2, 1, 2])
    t = one_hot_smooth(labels, 3, 0.1)
    torch.testing.assert_close(t.sum(-1), torch.ones(4))
    assert t[0, 0] == pytest.approx(0.9 + 0.1 / 3) and t[0, 1] == pytest.approx(0.1 / 3)
    x = torch.arange(4.0)[:, None, None, None].expand(4, 3, 8, 8).contiguous()
    rng = np.random.default_rng(0)
    for _ in range(20):
        mx, target = Mixer(3, mixup_alpha=0.4, label_smoothing=0.1)(x, labels, rng)
        torch.testing.assert_close(target.sum(-1), torch.ones(4))
        # a mixup image is lam * x_i + (1 - lam) * x_partner; the target mixes with the same lam
        lam = (mx[0, 0, 0, 0] - 3.0) / (0.0 - 3.0)
        expected = lam * one_hot_smooth(labels, 3, 0.1)[0] + (1 - lam) * one_hot_smooth(labels, 3, 0.1)[3]
        torch.testing.assert_close(target[0], expected.float(), rtol=1e-5, atol=1e-6)


def test_cutmix_label_mass_equals_pasted_area() -> None:
    x = torch.zeros(2, 1, 10, 10)
    x[1] = 1.0
    labels = torch.tensor([0, 1])
    rng = np.random.default_rng(3)
    for _ in range(20):
        mx, target = Mixer(2, cutmix_alpha=1.0)(x, labels, rng)
        pasted = float(mx[0].mean())  # fraction of image 0 now showing image 1
        assert target[0, 1] == pytest.approx(pasted) and target[0].sum() == pytest.approx(1.0)
    assert torch.equal(Mixer(2)(x, labels, rng)[0], x)  # inactive: unchanged


def test_loader_is_resumable_and_splits_global_batches_across_ranks() -> None:
    ds = open_dataset("digits", "test")  # 359 images
    t = TrainTransform((8, 8), crop="pad", pad=1, flip=False, grayscale=True)
    full = TrainLoader(ds, t, global_batch=64, seed=5)
    assert full.steps_per_epoch == 5
    steps = list(full.epoch(2))
    assert len(steps) == 5 and steps[0][0].images.shape == (64, 1, 8, 8)
    # resuming at step 3 gives exactly steps 3 and 4
    later = list(full.epoch(2, start_step=3))
    for a, b in zip(later, steps[3:], strict=True):
        assert torch.equal(a[0].images, b[0].images) and torch.equal(a[0].labels, b[0].labels)
    # two ranks with accumulation 2: the four micro-batches tile the global batch of one process
    parts = [
        TrainLoader(ds, t, global_batch=64, seed=5, accum_steps=2, rank=r, world=2).epoch(2).__next__()
        for r in range(2)
    ]
    tiles = torch.cat([parts[r][m].indices for m in range(2) for r in range(2)])
    assert torch.equal(tiles, steps[0][0].indices)
    stacked = torch.cat([parts[r][m].images for m in range(2) for r in range(2)])
    assert torch.equal(stacked, steps[0][0].images)  # same augmentation whichever process decodes
    # with workers: identical batches
    workers = list(TrainLoader(ds, t, global_batch=64, seed=5, workers=2).epoch(2))
    assert all(torch.equal(a[0].images, b[0].images) for a, b in zip(workers, steps, strict=True))


def test_epoch_order_is_seeded_and_shard_local() -> None:
    assert np.array_equal(epoch_order(50, 1, 2), epoch_order(50, 1, 2))
    assert not np.array_equal(epoch_order(50, 1, 2), epoch_order(50, 1, 3))
    shard_of = np.repeat(np.arange(10), 5)  # 10 shards of 5
    order = epoch_order(50, 0, 0, shard_of=shard_of, window=2)
    assert sorted(order) == list(range(50))
    for w in range(5):  # each window of 10 samples comes from exactly 2 shards
        assert len(set(shard_of[order[10 * w : 10 * w + 10]])) == 2


class _PidTransform:
    """A train transform that paints the id of the process that decoded the sample."""

    def __call__(self, img: object, rng: np.random.Generator) -> torch.Tensor:
        return torch.full((1, 2, 2), float(os.getpid()), dtype=torch.float64)


def test_loader_workers_persist_across_epochs_with_the_same_batches() -> None:
    """Worker processes start once per run, not once per epoch (issue 13 item 10), and every epoch's batches
    (with a resume mid-epoch) still equal the single-process ones."""
    ds = open_dataset("digits", "test")
    t = TrainTransform((8, 8), crop="pad", pad=1, flip=True, grayscale=True)
    one = TrainLoader(ds, t, global_batch=64, seed=5)
    many = TrainLoader(ds, t, global_batch=64, seed=5, workers=2)
    for epoch, start in ((0, 0), (1, 2), (2, 0)):
        a, b = list(one.epoch(epoch, start)), list(many.epoch(epoch, start))
        assert len(a) == len(b) == 5 - start
        assert all(torch.equal(x[0].images, y[0].images) for x, y in zip(a, b, strict=True))
    pids = TrainLoader(ds, _PidTransform(), global_batch=64, seed=5, workers=2)  # type: ignore[arg-type]
    seen = [{float(v) for s in pids.epoch(e) for v in s[0].images.flatten().unique()} for e in range(3)]
    assert len(seen[0]) == 2 and os.getpid() not in seen[0]
    assert seen[0] == seen[1] == seen[2]  # the same two worker processes served every epoch
