"""Deterministic, resumable, rank-aware batching on top of ``torch.utils.data.DataLoader``.

Everything is a pure function of the seed, so an interrupted run can continue bit-for-bit:

- the order of an epoch is a permutation drawn from (seed, epoch);
- global step s of an epoch takes the slice ``order[s*G : (s+1)*G]`` (G = global batch); within it,
  micro-batch m (gradient accumulation) for rank r is the slice ``[m*G/A + r*b : m*G/A + (r+1)*b]``
  (A accumulation steps, b = G / (A * world)) -- so 1 process and N processes see the same samples per step;
- each sample's augmentation is drawn from (seed, epoch, index), whichever worker decodes it.

Resuming at step s of an epoch simply starts the batch sampler there. A bad sample (corrupt file) is
reported from the worker as a one-line DataError naming the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.data.image_dataset import ImageDataset
from vitkit.data.transforms import sample_rng
from vitkit.distributed import DistInfo, shard_steps
from vitkit.errors import ConfigError, DataError

SampleTransform = Callable[[Image.Image, np.random.Generator], torch.Tensor]


@dataclass
class Batch:
    """One batch from a loader: images, labels, their dataset indices and, when padded, which rows are
    real."""

    images: torch.Tensor  # (B, C, H, W)
    labels: torch.Tensor  # (B,) int64
    indices: torch.Tensor  # (B,) dataset indices, for debugging and tests
    valid: torch.Tensor | None = None  # (B,) bool: False marks padding (multi-process evaluation); None: all valid

    def pin_memory(self) -> Batch:
        """Page-locked copies, for ``DataLoader(pin_memory=True)`` (its pinning thread calls this on custom
        batch types): only from pinned memory do ``.to(cuda, non_blocking=True)`` copies overlap compute."""
        valid = None if self.valid is None else self.valid.pin_memory()
        return Batch(self.images.pin_memory(), self.labels.pin_memory(), self.indices.pin_memory(), valid)


@dataclass(frozen=True)
class _Bad:
    message: str


def epoch_order(n: int, seed: int, epoch: int, *, shard_of: np.ndarray | None = None, window: int = 4) -> np.ndarray:
    """The order of the n samples in ``epoch``.

    With ``shard_of`` (WebDataset shards), shards are visited in a random order and samples are shuffled
    only within windows of ``window`` consecutive shards, so that reading stays nearly sequential.
    """
    rng = np.random.default_rng([seed, epoch, 0x0D3E])
    if shard_of is None:
        return rng.permutation(n)
    shards = rng.permutation(int(shard_of.max()) + 1 if n else 0)
    members = [np.flatnonzero(shard_of == s) for s in range(len(shards))]
    parts = []
    for start in range(0, len(shards), window):
        idx = np.concatenate([members[s] for s in shards[start : start + window]])
        parts.append(idx[rng.permutation(idx.size)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class _Samples(torch.utils.data.Dataset):
    """Maps keys (epoch, index) to (tensor, label, index); decoding errors become a _Bad marker."""

    def __init__(
        self,
        dataset: ImageDataset,
        transform: SampleTransform | Callable[[Image.Image], torch.Tensor],
        seed: int,
        train: bool,
    ) -> None:
        self.dataset, self.transform, self.seed, self.train = dataset, transform, seed, train

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        try:
            # TrainTransform crops before it resizes, so it may decode a JPEG at reduced scale
            lazy = self.train and getattr(self.transform, "decodes_lazily", False)
            img, label = self.dataset.lazy_item(index) if lazy else self.dataset[index]
            fn: Any = self.transform
            x = fn(img, sample_rng(self.seed, epoch, index)) if self.train else fn(img)
        except DataError as e:
            return _Bad(str(e))
        return x, label, index


def _collate(items: list[Any]) -> Batch | _Bad:
    for it in items:
        if isinstance(it, _Bad):
            return it
    xs, labels, idx = zip(*items, strict=True)
    return Batch(torch.stack(xs), torch.tensor(labels, dtype=torch.int64), torch.tensor(idx, dtype=torch.int64))


class _KeySchedule:
    """A batch sampler whose batches of keys are set before each pass: one DataLoader (and, with workers,
    one set of persistent worker processes) serves every epoch of a run."""

    def __init__(self) -> None:
        self.keys: list[list[tuple[int, int]]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


def _dataloader(samples: _Samples, keys: Any, workers: int, pin: bool, persistent: bool = False) -> Any:
    return torch.utils.data.DataLoader(
        samples,
        batch_sampler=keys,
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=pin,
        prefetch_factor=4 if workers else None,
        persistent_workers=persistent and workers > 0,
    )


def _batches(dl: Any) -> Iterator[Batch]:
    for b in dl:
        if isinstance(b, _Bad):
            raise DataError(b.message)
        yield b


class TrainLoader:
    """Per-rank micro-batches of a training set, step by step, resumable at any step."""

    def __init__(
        self,
        dataset: ImageDataset,
        transform: SampleTransform,
        *,
        global_batch: int,
        seed: int,
        accum_steps: int = 1,
        rank: int = 0,
        world: int = 1,
        workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if global_batch % (accum_steps * world):
            raise ConfigError(
                f"batch size {global_batch} is not divisible by accumulation steps x processes "
                f"({accum_steps} x {world})"
            )
        if len(dataset) < global_batch:
            fits = len(dataset) // (accum_steps * world) * (accum_steps * world)
            per_step = accum_steps * world
            advice = f"choose --batch-size {fits} or less" if fits else f"a step needs {per_step} images at least"
            raise ConfigError(
                f"--batch-size: {global_batch} (a recipe's is sized for its own data set) is larger than the training "
                f"set ({len(dataset)} images); {advice} (--set data.batch_size=N; the warm-up is scaled to the run)"
            )
        self.dataset, self.seed, self.rank, self.world = dataset, seed, rank, world
        self.global_batch, self.accum_steps, self.workers = global_batch, accum_steps, workers
        self.micro_batch = global_batch // (accum_steps * world)
        self.samples = _Samples(dataset, transform, seed, train=True)
        self.pin_memory = pin_memory
        # workers persist across epochs (no process start-up and dataset copy per epoch); the keys of each
        # pass are set on the schedule, so every sample's draws stay a function of (seed, epoch, index)
        self._schedule = _KeySchedule()
        self._dl: Any = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch  # the last partial batch of an epoch is dropped

    def step_indices(self, order: np.ndarray, step: int) -> list[np.ndarray]:
        """This rank's micro-batches (dataset indices) of one step, given the epoch's order."""
        G, A, b = self.global_batch, self.accum_steps, self.micro_batch
        out = []
        for m in range(A):
            start = step * G + m * (G // A) + self.rank * b
            out.append(order[start : start + b])
        return out

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self.dataset), self.seed, epoch, shard_of=getattr(self.dataset, "shard_of", None))

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
        """Yield, for each step from ``start_step`` to the end of the epoch, the list of A micro-batches."""
        order = self.order(epoch)
        self._schedule.keys = [
            [(epoch, int(i)) for i in micro]
            for step in range(start_step, self.steps_per_epoch)
            for micro in self.step_indices(order, step)
        ]
        if self._dl is None:
            self._dl = _dataloader(self.samples, self._schedule, self.workers, self.pin_memory, persistent=True)
        it = _batches(self._dl)
        while True:
            group = [b for _, b in zip(range(self.accum_steps), it, strict=False)]
            if not group:
                return
            yield group


def eval_batches(
    dataset: ImageDataset,
    transform: Callable[[Image.Image], torch.Tensor],
    batch_size: int,
    *,
    rank: int = 0,
    world: int = 1,
    workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[Batch]:
    """Every sample once, in batches dealt out as every batch job deals them (:func:`vitkit.distributed.shard_steps`:
    batch ``c`` to rank ``c % world``), the batch no larger than ``ceil(n / world)`` so that every rank has one.

    Every rank yields the same number of batches of the same sizes: a sharded (FSDP) model enters collectives
    in every forward pass, so a rank that stopped one batch early would leave the others waiting forever.
    A rank short of rank 0's batches fills up with repeats of sample 0, marked with ``Batch.valid`` False;
    leave them out of every count.
    """
    n = len(dataset)
    size = min(batch_size, max(1, -(-n // world)))
    mine, steps = shard_steps(range(n), size, DistInfo(rank=rank, world=world))
    keys = [[(0, i) for i in mine[k * size : (k + 1) * size]] for k in range(steps)]
    real = [len(k) for k in keys]
    for k, key in enumerate(keys):  # up to rank 0's batch of the step (batch k * world): the largest
        key += [(0, 0)] * (min(size, n - k * world * size) - len(key))
    batches = _batches(_dataloader(_Samples(dataset, transform, 0, train=False), keys, workers, pin_memory))
    for count, b in zip(real, batches, strict=True):
        if count < len(b.labels):
            b.valid = torch.arange(len(b.labels)) < count
        yield b
