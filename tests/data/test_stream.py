"""``vitkit.data.stream``: a decoding worker that never answers stops the job with one line (issue 32)."""

from __future__ import annotations

import time

import pytest
import torch

from vitkit.data import stream
from vitkit.data.stream import ImageSource, stream_batches
from vitkit.errors import DataError


class _Stuck(ImageSource):
    """Two items; the second takes longer than any timeout (a file that never ends)."""

    def __len__(self) -> int:
        return 2

    def item_id(self, index: int) -> str:
        return f"item{index}"

    def load(self, index: int, lazy: bool) -> tuple[object, int]:  # type: ignore[override]
        if index == 1:
            time.sleep(30)
        return torch.zeros(3, 2, 2), 0


def test_a_worker_that_never_answers_is_one_line_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "WORKER_TIMEOUT", 2)
    batches = stream_batches(_Stuck(), lambda img, item_id: img, 1, workers=1)
    start = time.perf_counter()
    assert next(batches).ids == ["item0"]
    with pytest.raises(DataError, match="a decoding worker gave no batch in 2 s"):
        next(batches)
    assert time.perf_counter() - start < 20


class Ones(ImageSource):
    def __len__(self) -> int:
        return 5

    def item_id(self, index: int) -> str:
        return str(index)

    def load(self, index: int, lazy: bool) -> tuple[torch.Tensor, int]:  # type: ignore[override]
        return torch.ones(3, 4, 4), -1


def test_the_workers_are_let_go_once_the_last_batch_has_arrived() -> None:
    """A job takes its count of batches and never asks past the end (run_job); the workers still exit then, while
    the stream is alive, not when it is collected (when the job's thread would wait for each in turn)."""
    import multiprocessing as mp

    batches = stream_batches(Ones(), lambda img, name: img, 2, workers=2)  # type: ignore[arg-type,return-value]
    got = [next(batches) for _ in range(3)]
    assert [len(b) for b in got] == [2, 2, 1]
    for _ in range(600):  # a bound, not a timing: the two workers exit, or the test fails after 60 s
        if not mp.active_children():
            break
        time.sleep(0.1)
    assert not mp.active_children()
    assert next(batches, None) is None  # and the stream ends as before
