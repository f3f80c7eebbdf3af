"""hardware.CpuShare: the thread count follows the cores other programs leave free (issue 48, item 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from vitkit import hardware
from vitkit.hardware import CpuShare


class FakeProc:
    """/proc as CpuShare reads it: the machine's busy/total jiffies and this process's own, advanced by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
        self.cores, self.busy, self.total, self.own, self.now = cores, 0, 0, 0, 0.0
        monkeypatch.setattr(hardware, "_cpu_jiffies", lambda cpus: (self.busy, self.total))
        monkeypatch.setattr(hardware, "_own_jiffies", lambda: self.own)

    def advance(self, seconds: float, mine: float, others: float) -> None:
        """``seconds`` of wall time in which this process used ``mine`` cores and other programs ``others``."""
        ticks = seconds * 100
        self.now += seconds
        self.total += int(ticks * self.cores)
        self.busy += int(ticks * min(self.cores, mine + others))
        self.own += int(ticks * mine)


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(hardware, "_physical_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_busy_core_costs_a_thread_then_it_comes_back(monkeypatch, two_threads):
    proc, said = FakeProc(monkeypatch, cores=2), []
    share = CpuShare(say=said.append, clock=lambda: proc.now)
    assert share.active and share.threads == 2
    proc.advance(0.6, mine=1.33, others=0.67)  # two threads against one busy program: the scheduler splits 2 cores
    share.tick()
    assert torch.get_num_threads() == 1
    assert len(said) == 1 and "0.7 of this machine's 2 cores" in said[0] and "runs 1 thread instead of 2" in said[0]
    for _ in range(3):  # still busy: stays at one thread, and says nothing more
        proc.advance(2.1, mine=1.0, others=1.0)
        share.tick()
    assert torch.get_num_threads() == 1 and len(said) == 1
    proc.advance(2.1, mine=1.0, others=0.05)  # the other program stopped
    share.tick()
    assert torch.get_num_threads() == 2 and len(said) == 1
    proc.advance(2.1, mine=1.3, others=0.7)
    share.tick()
    assert torch.get_num_threads() == 1
    share.close()
    assert torch.get_num_threads() == 2


def test_a_quiet_machine_keeps_every_thread(monkeypatch, two_threads):
    proc, said = FakeProc(monkeypatch, cores=2), []
    share = CpuShare(say=said.append, clock=lambda: proc.now)
    for _ in range(5):
        proc.advance(2.1, mine=1.95, others=0.2)  # background noise below half a core
        share.tick()
    assert torch.get_num_threads() == 2 and said == []


def test_looks_only_every_interval(monkeypatch, two_threads):
    proc = FakeProc(monkeypatch, cores=2)
    share = CpuShare(clock=lambda: proc.now)
    proc.advance(0.2, mine=1.0, others=1.0)
    share.tick()  # too early for the first look (0.5 s)
    assert torch.get_num_threads() == 2 and share.ticks == 0


def test_a_chosen_thread_count_is_left_alone(monkeypatch, two_threads):
    proc = FakeProc(monkeypatch, cores=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # as torchrun sets it, or a user
    share = CpuShare(clock=lambda: proc.now)
    proc.advance(3, mine=1.0, others=1.0)
    share.tick()
    assert not share.active and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(1)  # torch.set_num_threads called by the user (not one per core): left alone too
    assert not CpuShare(clock=lambda: proc.now).active


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2, reason="2 cores")
def test_a_real_competing_process_is_seen(two_threads):
    """The real /proc readings: one CPU-bound program (not a child of this process: children are the job's own
    decoding workers) beside two threads of matrix products."""
    spawn = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    hog = int(subprocess.run(["sh", "-c", spawn], capture_output=True, text=True, check=True).stdout)
    said: list[str] = []
    try:
        time.sleep(0.3)
        share = CpuShare(say=said.append, interval_s=0.5)
        assert share.active
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        end = time.monotonic() + 4
        while time.monotonic() < end and torch.get_num_threads() == 2:
            a @ b
            share.tick()
        assert torch.get_num_threads() == 1, "a busy core was not seen"
        assert len(said) == 1
    finally:
        os.kill(hog, signal.SIGKILL)
    end = time.monotonic() + 4
    while time.monotonic() < end and torch.get_num_threads() == 1:
        a @ b
        share.tick()
    assert torch.get_num_threads() == 2, "the core given back was not taken again"
