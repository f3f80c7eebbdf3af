"""Batching for several processes: every rank must enter the same number of forward passes."""

from __future__ import annotations

import pytest
import torch

from vitkit.data.datasets import open_dataset
from vitkit.data.loader import eval_batches


def _to_tensor(img: object) -> torch.Tensor:
    return torch.zeros(1, 2, 2)


@pytest.mark.parametrize(("n_world", "batch"), [(2, 179), (3, 100), (4, 512), (2, 1)])
def test_eval_batches_are_equal_in_number_and_size_on_every_rank(n_world: int, batch: int) -> None:
    """359 digits test images over 2 ranks with batches of 179: rank 0 has 180 samples (2 batches), rank 1 has
    179 (1 batch) -- an FSDP model all-gathers its parameters in every forward, so rank 0's second batch would
    wait forever for rank 1. Rank 1 pads with a repeat of one of its samples, marked invalid."""
    ds = open_dataset("digits", "test")
    assert len(ds) == 359
    per_rank = [list(eval_batches(ds, _to_tensor, batch, rank=r, world=n_world)) for r in range(n_world)]
    sizes = [[len(b.labels) for b in batches] for batches in per_rank]
    assert all(s == sizes[0] for s in sizes)  # same number of batches, same sizes
    seen: list[int] = []
    for r, batches in enumerate(per_rank):
        for b in batches:
            keep = b.valid if b.valid is not None else torch.ones(len(b.labels), dtype=torch.bool)
            assert set(b.indices[~keep].tolist()) <= set(range(r, 359, n_world)) | {0}  # padding repeats a sample
            seen += b.indices[keep].tolist()
    assert sorted(seen) == list(range(359))  # every sample exactly once among the valid ones


def test_one_process_is_never_padded() -> None:
    ds = open_dataset("digits", "test")
    batches = list(eval_batches(ds, _to_tensor, 100))
    assert [len(b.labels) for b in batches] == [100, 100, 100, 59]
    assert all(b.valid is None for b in batches)


@pytest.mark.parametrize(("n_world", "batch"), [(2, 179), (3, 100), (4, 512)])
def test_validation_deals_batches_as_the_batch_jobs_do(n_world: int, batch: int) -> None:
    """One sharding scheme: a rank's real samples in a training run's validation are its share of the batch jobs'
    deal (vitkit.distributed.shard_steps, the batch capped at ceil(n / world)), in the same order."""
    from vitkit.distributed import DistInfo, shard_steps

    ds = open_dataset("digits", "test")
    size = min(batch, -(-len(ds) // n_world))
    for r in range(n_world):
        got = [i for b in eval_batches(ds, _to_tensor, batch, rank=r, world=n_world)
               for i in (b.indices if b.valid is None else b.indices[b.valid]).tolist()]  # fmt: skip
        assert got == shard_steps(range(len(ds)), size, DistInfo(rank=r, world=n_world))[0]
