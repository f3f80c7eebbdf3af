"""The decoding workers reuse their shared batch buffers only once the job's process has let a batch go: a
consumer that keeps batches, or views of their images, keeps them intact, and one that drops each batch gets
every batch through the reused buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.eval_transform import EvalTransform
from vitkit.data.stream import FileSource, list_inputs, stream_batches


def source(folder: Path, n: int = 40) -> FileSource:
    folder.mkdir()
    for i in range(n):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")
    return FileSource(list_inputs([folder]))


def test_batches_kept_or_dropped_are_never_overwritten(tmp_path: Path) -> None:
    src = source(tmp_path / "in")
    for uint8 in (True, False):
        t = EvalTransform(Preprocess(image_size=8), uint8=uint8)
        want = [b.images.clone() for b in stream_batches(src, t, 4)]  # in this process: no shared buffers

        kept = list(stream_batches(src, t, 4, workers=2, prefetch=1))  # every batch held to the end
        assert all(torch.equal(b.images, w) for b, w in zip(kept, want, strict=True))
        assert kept[-1].slot == -1  # the workers ran out of free slots and stacked into new buffers

        views = [b.images[:, 0] for b in stream_batches(src, t, 4, workers=2, prefetch=1)]  # views only
        assert all(torch.equal(v, w[:, 0]) for v, w in zip(views, want, strict=True))

        slots = []
        for b, w in zip(stream_batches(src, t, 4, workers=2, prefetch=1), want, strict=True):
            assert torch.equal(b.images, w)  # each batch dropped once looked at
            slots.append(b.slot)
        assert sum(s >= 0 for s in slots) >= len(slots) - 2 and len(set(slots) - {-1}) <= 4  # 2 slots x 2 workers


def test_default_workers_follow_where_the_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model on the CPU leaves the cores to its forward pass (one decoder per four cores); on a GPU every core
    but the job's own decodes (the H100 machine: 16 cores, 15 workers; the issue measured 4 by default)."""
    from vitkit.commands.args import resolve_workers
    from vitkit.data import stream

    assert [stream.default_workers(c) for c in (1, 2, 8, 16, 64)] == [1, 1, 2, 4, 8]
    assert [stream.default_workers(c, gpu=True) for c in (1, 2, 16, 64)] == [1, 1, 15, 16]
    monkeypatch.setattr(stream, "default_workers", lambda cores=None, gpu=False: 15 if gpu else 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a named GPU must exist (resolve_device)
    assert resolve_workers(3, "cuda") == 3 and resolve_workers(None, "cpu") == 4
    assert resolve_workers(None, "cuda:1") == 15 and resolve_workers(None, torch.device("cuda", 0)) == 15
    assert resolve_workers(None, "auto") == 15
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_workers(None, "auto") == 4
