"""Keeping freed memory in the process's heap while a training loop runs (glibc's allocator).

A training step allocates and frees the same large activations every step (S/16 at batch 32: ~1 GB). With
glibc's default settings, blocks above its mmap threshold are mapped and unmapped on every allocation, and
the free memory at the top of the heap is returned to the system at every step's end; each time the kernel
hands the pages back they are faulted in and zeroed again: 70-180 thousand page faults and ~0.1 s of system
time per S/16 step on 2 cores (BENCHMARKS.md). :func:`heap_kept` serves every allocation from the heap and
keeps freed memory there for the next step; on exit it returns the free memory (``malloc_trim``) and leaves
the thresholds where glibc's own dynamic rule takes them once a large block has been freed (mmap above
32 MiB, trim above 64 MiB). Elsewhere than glibc (macOS, musl) it does nothing. On whole ``fit()`` runs
(S/16 and the digits job, BENCHMARKS.md) it costs no peak memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's <malloc.h>
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_KEEP = (1 << 31) - 1  # the largest value mallopt takes: never trim while training
MMAP_MAX_DEFAULT = 65536  # glibc's DEFAULT_MMAP_MAX


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (with ``mallopt`` and ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them (no ldconfig child process)
        libc.gnu_get_libc_version  # noqa: B018  # only glibc has it
        libc.mallopt  # noqa: B018
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def heap_kept() -> Iterator[bool]:
    """Within the block, allocations come from the heap and freed memory stays there; yields whether the
    allocator is glibc's (False: nothing changed)."""
    libc = glibc()
    if libc is None:
        yield False
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_KEEP)
    try:
        yield True
    finally:
        libc.mallopt(M_MMAP_MAX, MMAP_MAX_DEFAULT)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
        libc.malloc_trim(0)
