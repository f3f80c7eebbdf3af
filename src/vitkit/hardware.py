"""What the machine can do: CPU instruction sets, native bf16, int8 dot products, and the one device resolver.

Every part of vitkit that picks a device (training, evaluation, analysis, benchmarks, inference) goes through
:func:`resolve_device`, and every capability check through the functions here, so "auto" means one thing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vitkit.errors import ConfigError

#: Decoding/loading worker processes a job may start, per CPU core this process may run on (``--workers``,
#: ``data.workers``): a few per core keeps a slow disk busy; ``--workers 100000`` forked ~990 processes
WORKERS_PER_CORE = 8


def cpu_count() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_workers() -> int:
    """The most worker processes a job may start on this machine: :data:`WORKERS_PER_CORE` per core."""
    return WORKERS_PER_CORE * cpu_count()


def total_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def _cpuinfo(key: str) -> str | None:
    """What follows the colon on the first line of /proc/cpuinfo that starts with ``key`` (None when there is no
    such line, or no readable file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1] for line in lines if line.startswith(key)), None)


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty when unavailable)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where it is unavailable; may be empty)."""
    import platform

    model = _cpuinfo("model name")
    return platform.processor() if model is None else model.strip()


def has_native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes in bf16 natively: a CUDA GPU that supports it, or a CPU with AVX512_BF16
    or AMX. Elsewhere PyTorch emulates bf16 matmuls, tens of times slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and bool(torch.cuda.is_bf16_supported())
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_onednn_linear(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch has oneDNN's packed linear kernels for ``dtype`` here (x86 CPUs; bf16 needs CPU
    support)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


def has_amx_int8() -> bool:
    """Whether this CPU has AMX's int8 tiles (Sapphire Rapids and later Xeons): oneDNN's int8 GEMMs run on them."""
    return "amx_int8" in cpu_flags()


def has_vnni() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX)."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def resolve_device(name: str | None = "auto", local_rank: int = 0) -> torch.device:
    """``None``/"auto": this process's GPU (``cuda:<local_rank>``) when CUDA is available, else the CPU.
    A named device is checked to exist; a bare "cuda" means this process's GPU."""
    if name in (None, "", "auto"):
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device: unknown device {name!r} (use cpu, cuda, cuda:1, mps or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available on this machine")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def has_tf32(device: torch.device | str) -> bool:
    """Whether fp32 matmuls on ``device`` can run on TF32 tensor cores: CUDA GPUs of compute capability 8.0
    (Ampere) and later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def use_tf32(device: torch.device, enabled: bool = True) -> tuple[str, bool]:
    """fp32 matmuls on TF32 tensor cores where ``device`` has them (PyTorch's default is full fp32); with
    ``enabled`` False, full fp32 for matmuls and cuDNN convolutions too (PyTorch lets cuDNN use TF32 by default).
    Returns the previous settings, for :func:`restore_tf32` when done."""
    previous = torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)
    if not enabled:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    elif has_tf32(device):
        torch.set_float32_matmul_precision("high")
    return previous


def restore_tf32(previous: tuple[str, bool]) -> None:
    """Put back the settings :func:`use_tf32` returned."""
    torch.set_float32_matmul_precision(previous[0])
    torch.backends.cudnn.allow_tf32 = previous[1]


# ---- sharing the CPU with other programs --------------------------------------------------------------------------

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (steal: the hypervisor gave the core away)


def _cpu_jiffies(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies of ``cpus`` since boot from /proc/stat; None where it cannot be read."""
    busy = total = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        fields = [int(v) for v in rest.split()[:8]]
        busy += sum(fields[i] for i in _BUSY_FIELDS if i < len(fields))
        total += sum(fields)
    return (busy, total) if total else None


def _own_jiffies() -> int:
    """CPU jiffies used by this process and the processes it started (decoding workers), live ones included."""
    used, todo, seen = 0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            used += int(fields[11]) + int(fields[12])  # utime stime
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return used


@dataclass
class CpuShare:
    """Keeps PyTorch's thread count (and so vitkit's kernels', which take it per call) at the cores that other
    programs leave free, while a job runs.

    On a machine where another program keeps a core busy, a job that runs one thread per core loses far more
    than that core: every parallel region waits at its barrier for the thread the scheduler has set aside (on a
    2-core Zen 5 the default digits job took 3.3x as long with one busy competitor, while one thread took 1.45x;
    10-25x was seen elsewhere). So every ``interval_s`` of wall time, :meth:`tick` reads what this machine's
    cores did (``/proc/stat``, steal time included) less what this process and its workers did, and sets the
    threads to the cores left (at least one, at most what the job started with); it gives them back when the
    other program stops, and at :meth:`close`. It says so once, through ``say``.

    It stays out of the way where the thread count was chosen: ``OMP_NUM_THREADS`` set (torchrun sets it per
    process), or ``torch.set_num_threads`` called with another count than one per core; and where /proc is not
    there (not Linux)."""

    say: Callable[[str], None] | None = None
    interval_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    threads: int = 0  # what the job started with (0 until started)
    fewest: int = 0  # the fewest threads it ran with (below ``threads``: the count changed mid-job)
    active: bool = False
    said: bool = False
    ticks: int = 0  # looks taken
    _last: tuple[float, tuple[int, int], int] | None = None
    _cpus: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        self.threads = self.fewest = torch.get_num_threads()
        chosen = "OMP_NUM_THREADS" in os.environ or self.threads != min(len(self._cpus), _physical_cores())
        self.active = self.threads > 1 and not chosen and _cpu_jiffies(self._cpus) is not None
        self._last = self._sample() if self.active else None

    def _sample(self) -> tuple[float, tuple[int, int], int]:
        return self.clock(), _cpu_jiffies(self._cpus) or (0, 0), _own_jiffies()

    def tick(self) -> None:
        """Cheap when called often (a clock read); every ``interval_s``, the threads set to the free cores."""
        wait = self.interval_s if self.ticks else min(0.5, self.interval_s)  # the first look comes early
        if not self.active or self._last is None or self.clock() - self._last[0] < wait:
            return
        self.ticks += 1
        now = self._sample()
        (_, (busy0, total0), own0), (_, (busy1, total1), own1) = self._last, now
        self._last = now
        if total1 <= total0:
            return
        cores = len(self._cpus)
        others = max(0.0, (busy1 - busy0) / (total1 - total0) * cores - (own1 - own0) / ((total1 - total0) / cores))
        self.set(max(1, min(self.threads, int(cores - others + 0.5))), others)

    def set(self, want: int, others: float) -> None:
        """``want`` threads from now on (``others``: the cores other programs used, for the one-time note)."""
        if want == torch.get_num_threads():
            return
        torch.set_num_threads(want)
        self.fewest = min(self.fewest, want)
        if want < self.threads and not self.said and self.say is not None:
            self.said = True
            self.say(
                f"note: other programs are using {others:.1f} of this machine's {len(self._cpus)} cores; vitkit "
                f"runs {want} thread{'s' * (want > 1)} instead of {self.threads} while they do (set OMP_NUM_THREADS "
                "to choose the count)"
            )

    def close(self) -> None:
        """The thread count the job started with, back."""
        if self.active and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def _physical_cores() -> int:
    """PyTorch's default thread count: the physical cores (logical CPUs over threads per core), as its OpenMP
    runtime counts them; the logical CPUs where that cannot be read."""
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
        spans = (p.partition("-") for p in siblings.split(","))
        per_core = sum(int(b or a) - int(a) + 1 for a, _, b in spans)
    except (OSError, ValueError):
        per_core = 1
    return max(1, (os.cpu_count() or 1) // max(1, per_core))
