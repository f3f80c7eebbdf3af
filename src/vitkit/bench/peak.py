"""The machine's peak arithmetic rate, measured in the same run as the benchmark it scales.

Two ways, tried in order, and the result always says which one it is:

- ``"fma-loop"`` (CPU): a tiny C kernel of independent vector multiply-adds (``vfmadd`` for fp32,
  ``vdpbf16ps`` for bf16, ``vpdpbusd`` for int8), compiled at run time with the system C compiler and
  called through ctypes on every core at once. This is the instruction-throughput ceiling: no real
  program beats it, and large GEMMs reach 70-90% of it.
- ``"matmul"``: the best rate of large square matrix products in that dtype (CPU or CUDA). Used when no C
  compiler is present, the CPU lacks the instructions, or the device is a GPU. It is a lower, achievable
  ceiling, so fractions of it read higher than fractions of an instruction peak.

FLOPs count 2 per multiply-add (and 2 per int8 multiply-add, "OP/s").
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Each kernel runs `iters` rounds of ACC independent multiply-adds on 512-bit registers; ACC covers the
# instruction latency so that the loop is throughput-bound. Returns a value derived from every
# accumulator so that nothing is optimised away.
_C_SOURCE = r"""
#include <immintrin.h>
#define ACC 12
#define ROUND(OP) \
    a0 = OP(a0, x, y); a1 = OP(a1, x, y); a2 = OP(a2, x, y); a3 = OP(a3, x, y); \
    a4 = OP(a4, x, y); a5 = OP(a5, x, y); a6 = OP(a6, x, y); a7 = OP(a7, x, y); \
    a8 = OP(a8, x, y); a9 = OP(a9, x, y); a10 = OP(a10, x, y); a11 = OP(a11, x, y);
// distinct starting values: identical accumulators would be merged by the compiler
#define INIT(T, SET) T a0 = SET(0), a1 = SET(1), a2 = SET(2), a3 = SET(3), a4 = SET(4), a5 = SET(5), \
    a6 = SET(6), a7 = SET(7), a8 = SET(8), a9 = SET(9), a10 = SET(10), a11 = SET(11);
#define SUM_PS (_mm512_reduce_add_ps(a0) + _mm512_reduce_add_ps(a1) + _mm512_reduce_add_ps(a2) + \
    _mm512_reduce_add_ps(a3) + _mm512_reduce_add_ps(a4) + _mm512_reduce_add_ps(a5) + \
    _mm512_reduce_add_ps(a6) + _mm512_reduce_add_ps(a7) + _mm512_reduce_add_ps(a8) + \
    _mm512_reduce_add_ps(a9) + _mm512_reduce_add_ps(a10) + _mm512_reduce_add_ps(a11))

#define FMA_PS(a, x, y) _mm512_fmadd_ps(x, y, a)
double vk_fp32(long iters, float seed) {
    __m512 x = _mm512_set1_ps(seed), y = _mm512_set1_ps(1.0f - 1e-7f);
#define SET_PS(i) _mm512_set1_ps(seed + (float)(i))
    INIT(__m512, SET_PS)
    for (long i = 0; i < iters; i++) { ROUND(FMA_PS) }
    return SUM_PS;
}

#ifdef VK_BF16
#define DP_BF16(a, x, y) _mm512_dpbf16_ps(a, x, y)
double vk_bf16(long iters, float seed) {
    __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(seed));
    __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(1e-7f));
    INIT(__m512, SET_PS)
    for (long i = 0; i < iters; i++) { ROUND(DP_BF16) }
    return SUM_PS;
}
#endif

#ifdef VK_VNNI
#define DP_U8(a, x, y) _mm512_dpbusd_epi32(a, x, y)
double vk_int8(long iters, float seed) {
    __m512i x = _mm512_set1_epi8((char)(int)seed), y = _mm512_set1_epi8(1);
#define SET_EPI(i) _mm512_set1_epi32(i)
    INIT(__m512i, SET_EPI)
    for (long i = 0; i < iters; i++) { ROUND(DP_U8) }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
        _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
    return (double)_mm512_reduce_add_epi32(s);
}
#endif
"""

_ACC = 12
# FLOPs (or int OPs) of one 512-bit instruction: lanes x products per lane x 2.
_OPS_PER_INSTR = {"fp32": 16 * 1 * 2, "bf16": 16 * 2 * 2, "int8": 16 * 4 * 2}
_SYMBOL = {"fp32": "vk_fp32", "bf16": "vk_bf16", "int8": "vk_int8"}
_CPU_FLAG = {"fp32": "avx512f", "bf16": "avx512_bf16", "int8": "avx512_vnni"}
PRECISIONS = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class Peak:
    """A peak rate in FLOP/s (OP/s for int8), how it was measured, and on how many threads."""

    precision: str  # "fp32" | "bf16" | "int8"
    flops: float
    method: str  # "fma-loop" | "matmul"
    threads: int
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def _compiler() -> str | None:
    for name in (os.environ.get("CC") or "", "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build_kernels(flags: set[str], workdir: Path) -> ctypes.CDLL | None:
    """Compile the C kernels for the instructions this CPU has; None when that is impossible."""
    cc = _compiler()
    if cc is None or "avx512f" not in flags:
        return None
    args = ["-O2", "-shared", "-fPIC", "-mavx512f"]
    if "avx512_bf16" in flags:
        args += ["-mavx512bf16", "-mavx512bw", "-DVK_BF16"]
    if "avx512_vnni" in flags:
        args += ["-mavx512vnni", "-mavx512bw", "-DVK_VNNI"]
    tag = hashlib.sha1((_C_SOURCE + " ".join(args)).encode()).hexdigest()[:12]
    src, lib = workdir / f"vk_{tag}.c", workdir / f"vk_{tag}.so"
    src.write_text(_C_SOURCE)
    done = subprocess.run([cc, *args, str(src), "-o", str(lib)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    return ctypes.CDLL(str(lib))


def _run_threads(fn: Any, iters: int, threads: int) -> float:
    """Wall time of ``threads`` concurrent calls of fn(iters) (ctypes releases the GIL)."""
    barrier = threading.Barrier(threads + 1)

    def work(seed: float) -> None:
        barrier.wait()
        fn(iters, seed)

    pool = [threading.Thread(target=work, args=(1.0 + i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in pool:
        t.join()
    return time.perf_counter() - start


def fma_loop_peak(precision: str, threads: int | None = None, seconds: float = 0.3) -> Peak | None:
    """Instruction peak of this CPU for ``precision`` on ``threads`` cores; None if it cannot be measured."""
    flags = cpu_flags()
    if _CPU_FLAG[precision] not in flags:
        return None
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="vitkit-peak-") as tmp:
        lib = _build_kernels(flags, Path(tmp))
        if lib is None or not hasattr(lib, _SYMBOL[precision]):
            return None
        fn = getattr(lib, _SYMBOL[precision])
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_float]
        ops_per_iter = _ACC * _OPS_PER_INSTR[precision]
        iters = 100_000
        while (elapsed := _run_threads(fn, iters, 1)) < 0.05:  # calibrate one thread to ~50 ms
            iters *= 4
        iters = max(int(iters * seconds / 5 / elapsed), 1)
        best = min(_run_threads(fn, iters, threads) for _ in range(5))
    return Peak(precision, ops_per_iter * iters * threads / best, "fma-loop", threads, f"{_SYMBOL[precision]} x{_ACC}")


def matmul_peak(precision: str, device: torch.device | str = "cpu", size: int | None = None) -> Peak:
    """Best rate of a large square matmul in ``precision`` (int8 falls back to bf16's rate on CUDA/CPU)."""
    device = torch.device(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}[precision]
    n = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(4 if device.type == "cpu" else 20):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    detail = f"{n}x{n}x{n} {dtype}" + (" (int8 uses the bf16 rate)" if precision == "int8" else "")
    return Peak(precision, 2 * n**3 / best, "matmul", threads, detail)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak(precision: str, device: torch.device | str = "cpu", threads: int | None = None) -> Peak:
    """The instruction peak when it can be measured here, else the large-matmul rate."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if torch.device(device).type == "cpu":
        peak = fma_loop_peak(precision, threads)
        if peak is not None:
            return peak
    return matmul_peak(precision, device)


# Vendor dense (no sparsity) peak rates in TFLOP/s, bf16 and fp32 (tf32 off), for GPUs a run may land on.
_GPU_SPEC_TFLOPS = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp32": 66.9},  # SXM5
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
}


def gpu_spec_peak(device_name: str, precision: str) -> Peak | None:
    """The vendor's dense peak for a known GPU (matched by name), or None."""
    for key, rates in _GPU_SPEC_TFLOPS.items():  # ordered: "H100 PCIe" is tried before "H100"
        if key.lower() in device_name.lower() and precision in rates:
            return Peak(precision, rates[precision] * 1e12, "vendor-spec", 1, f"{key} dense {precision}")
    return None
