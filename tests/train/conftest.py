"""The training tests run at a fixed thread count.

On a busy machine vitkit's trainer follows the cores other programs leave (``hardware.CpuShare``), and sums that
PyTorch splits by the thread count (a bias's gradient over the batch, for one) then round differently: a run and
its resume are equal to float rounding, not bit for bit (docs/training.md). These tests assert bit-for-bit
equality, which holds at one thread count, so they fix it the way a user does, with ``OMP_NUM_THREADS`` (a CI
machine with another program on one core failed them otherwise)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fixed_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
