"""Timing and memory of one call: seconds per call of alternating runners with the CPU share they got, and
peak memory (CUDA allocator, or the process's resident set on Linux)."""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Timing:
    """Seconds per call of the timed repeats, and the CPU share the process got while they ran."""

    times: list[float]
    cpu_util: float  # process CPU time / (wall time x threads); ~1.0 on an otherwise idle machine

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
    fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device, threads: int, settle_s: float = 0.0
) -> dict[str, Timing]:
    """Time each fn ``repeats`` times, alternating between them call by call; ``settle_s`` of idle time
    before each call lets the previous runner's thread pool stop spinning (engines with their own pools)."""
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


def _rss_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _malloc_trim() -> None:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, float | None]:
    """Peak memory of one call of fn, in MiB.

    CUDA: peak allocated by the caching allocator during the call, and its increase over the memory held
    before. CPU: the process's peak resident set (VmHWM, reset before the call through
    /proc/self/clear_refs on Linux), and its increase over the resident set before the call (activations
    and workspace; freed heap pages are first returned to the OS with glibc's malloc_trim so that reusing
    them counts); ``None`` where the OS does not tell.
    """
    mib = 1024.0**2
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        top = torch.cuda.max_memory_allocated(device)
        return {"peak_mib": top / mib, "delta_mib": (top - held) / mib}
    _malloc_trim()  # hand freed heap pages back to the OS, so that reuse of them shows as growth
    before = _rss_bytes("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        resettable = True
    except OSError:
        resettable = False
    fn()
    high = _rss_bytes("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if high is None:
        return {"peak_mib": None, "delta_mib": None}
    return {"peak_mib": high / mib, "delta_mib": (high - before) / mib if resettable and before else None}
