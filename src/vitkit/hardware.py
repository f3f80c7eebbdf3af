"""What the machine can do: CPU instruction sets, native bf16, int8 dot products, and the one device resolver.

Every part of vitkit that picks a device (training, evaluation, analysis, benchmarks, inference) goes through
:func:`resolve_device`, and every capability check through the functions here, so "auto" means one thing.
"""

from __future__ import annotations

import os
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


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty when unavailable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where it is unavailable; may be empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


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
