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
