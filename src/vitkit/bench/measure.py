"""Memory of one call: peak memory (CUDA allocator, or the process's resident set on Linux). The timing of
alternating runners is :mod:`vitkit.timing` (inference's ``backend="auto"`` times its candidates with it too)."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitkit.timing import synchronize
from vitkit.train.heap import glibc


def _rss_bytes(field_name: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return None


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
    if (libc := glibc()) is not None:  # hand freed heap pages back to the OS, so that reuse of them shows as growth
        libc.malloc_trim(0)
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
