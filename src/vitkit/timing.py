"""Timing of alternating runners: seconds per call, and the CPU share the process got while they ran.

One implementation for every part of vitkit that picks the fastest of several ways by measurement
(``optimize_for_inference(..., backend="auto")``) and for ``vitkit bench``: the runners alternate call by
call, so a change in the machine's load during the measurement falls on all of them alike.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Timing:
    """Seconds per call of the timed repeats, and the CPU share the process got while they ran."""

    times: list[float]
    cpu_util: float  # process CPU time / (wall time x threads); ~1.0 on an otherwise idle machine

    def __post_init__(self) -> None:
        if not self.times:  # the statistics below have nothing to stand on
            raise ValueError("Timing: times is empty (at least one timed call is needed)")

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> tuple[float, float]:
        if len(self.times) < 2:
            return (self.times[0], self.times[0])
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q[0], q[2])

    def to_dict(self) -> dict[str, Any]:
        q1, q3 = self.iqr
        return {
            "median_s": self.median,
            "q1_s": q1,
            "q3_s": q3,
            "min_s": min(self.times),
            "times_s": self.times,
            "cpu_util": self.cpu_util,
        }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_alternating(
    fns: Mapping[str, Callable[[], Any]], repeats: int, device: torch.device, threads: int, settle_s: float = 0.0
) -> dict[str, Timing]:
    """Time each fn ``repeats`` times, alternating between them call by call; ``settle_s`` of idle time
    before each call lets the previous runner's thread pool stop spinning (engines with their own pools)."""
    if repeats < 1:
        raise ValueError(f"time_alternating: repeats must be at least 1, got {repeats}")
    if threads < 1:
        raise ValueError(f"time_alternating: threads must be at least 1, got {threads}")
    if not settle_s >= 0:  # negative or NaN
        raise ValueError(f"time_alternating: settle_s must be a non-negative number of seconds, got {settle_s}")
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, float] = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            if settle_s:
                time.sleep(settle_s)
            c0, t0 = _cpu_seconds(), time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
            cpu[name] += _cpu_seconds() - c0
    return {
        k: Timing(v, cpu[k] / (sum(v) * threads) if device.type == "cpu" else float("nan")) for k, v in times.items()
    }
