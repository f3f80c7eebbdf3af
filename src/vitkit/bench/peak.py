"""The machine's peak arithmetic rate, measured in the same run as the benchmark it scales.

Two ways, tried in order, and the result always says which one it is:

- ``"fma-loop"`` (CPU): a tiny C kernel of independent vector multiply-adds (512-bit ``vfmadd`` for fp32,
  or 256-bit on AVX2-only CPUs; ``vdpbf16ps`` for bf16, ``vpdpbusd`` for int8), compiled at run time with
  the system C compiler (``vitkit.native``, cached per content) and called through ctypes on every core at
  once. This is the instruction-throughput ceiling: no real program beats it, and large GEMMs reach 70-90% of it. A CPU
  without bf16 instructions gets its fp32 FMA rate as the bf16 peak (bf16 work cannot run faster there).
- ``"matmul"``: the best rate of large square matrix products in that dtype (CPU or CUDA; int8 on oneDNN's
  int8 GEMM). Used when no C compiler is present, the CPU lacks the instructions (int8 without VNNI), or
  the device is a GPU. It is a lower, achievable ceiling, so fractions of it read higher than fractions of
  an instruction peak.

FLOPs count 2 per multiply-add (and 2 per int8 multiply-add, "OP/s").
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vitkit import hardware, native
from vitkit.timing import synchronize

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

#ifdef VK_AVX2
#define SET_PS256(i) _mm256_set1_ps(seed + (float)(i))
#define FMA_PS256(a, x, y) _mm256_fmadd_ps(x, y, a)
static float red256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#define RED256(v) red256(v)
double vk_fp32_avx2(long iters, float seed) {
    __m256 x = _mm256_set1_ps(seed), y = _mm256_set1_ps(1.0f - 1e-7f);
    INIT(__m256, SET_PS256)
    for (long i = 0; i < iters; i++) { ROUND(FMA_PS256) }
    return RED256(a0) + RED256(a1) + RED256(a2) + RED256(a3) + RED256(a4) + RED256(a5) + RED256(a6) +
        RED256(a7) + RED256(a8) + RED256(a9) + RED256(a10) + RED256(a11);
}
#endif

#ifdef VK_AVX512
#define FMA_PS(a, x, y) _mm512_fmadd_ps(x, y, a)
double vk_fp32(long iters, float seed) {
    __m512 x = _mm512_set1_ps(seed), y = _mm512_set1_ps(1.0f - 1e-7f);
#define SET_PS(i) _mm512_set1_ps(seed + (float)(i))
    INIT(__m512, SET_PS)
    for (long i = 0; i < iters; i++) { ROUND(FMA_PS) }
    return SUM_PS;
}
#endif

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
# Per precision, the kernels in order of preference: (symbol, CPU flags it needs, FLOPs or int OPs of one
# instruction = lanes x products per lane x 2).
_KERNELS = {
    "fp32": (("vk_fp32", ("avx512f",), 16 * 1 * 2), ("vk_fp32_avx2", ("avx2", "fma"), 8 * 1 * 2)),
    "bf16": (("vk_bf16", ("avx512f", "avx512_bf16"), 16 * 2 * 2),),
    "int8": (("vk_int8", ("avx512f", "avx512_vnni"), 16 * 4 * 2),),
}
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


def _build_kernels(flags: set[str]) -> ctypes.CDLL | None:
    """The C kernels compiled for the instructions this CPU has (``vitkit.native``); None when impossible."""
    args: list[str] = []
    if {"avx2", "fma"} <= flags:
        args += ["-mavx2", "-mfma", "-DVK_AVX2"]
    if "avx512f" in flags:
        args += ["-mavx512f", "-DVK_AVX512"]
        if "avx512_bf16" in flags:
            args += ["-mavx512bf16", "-mavx512bw", "-DVK_BF16"]
        if "avx512_vnni" in flags:
            args += ["-mavx512vnni", "-mavx512bw", "-DVK_VNNI"]
    if not args:  # no kernel this CPU can run
        return None
    return native.load(_C_SOURCE, "vk_peak", args)


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
    """Instruction peak of this CPU for ``precision`` on ``threads`` cores; None if it cannot be measured
    (no compiler, or no instruction for ``precision``: bf16 without AVX512_BF16, int8 without VNNI)."""
    flags = hardware.cpu_flags()
    usable = [k for k in _KERNELS[precision] if set(k[1]) <= flags]
    if not usable:
        return None
    threads = threads or torch.get_num_threads()
    lib = _build_kernels(flags)
    kernel = next((k for k in usable if lib is not None and hasattr(lib, k[0])), None)
    if lib is None or kernel is None:
        return None
    symbol, _, ops_per_instr = kernel
    fn = getattr(lib, symbol)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_float]
    ops_per_iter = _ACC * ops_per_instr
    iters = 100_000
    while (elapsed := _run_threads(fn, iters, 1)) < 0.05:  # calibrate one thread to ~50 ms
        iters *= 4
    iters = max(int(iters * seconds / 5 / elapsed), 1)
    best = min(_run_threads(fn, iters, threads) for _ in range(5))
    return Peak(precision, ops_per_iter * iters * threads / best, "fma-loop", threads, f"{symbol} x{_ACC}")


def _int8_gemm(n: int) -> Callable[[], Any] | None:
    """One (n, n) x (n, n) int8 GEMM on oneDNN's kernels (u8 activations, s8 weights), or None."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return None
    packed = ops.qlinear_prepack(torch.randint(-100, 100, (n, n), dtype=torch.int8), [n, n])
    x = torch.randint(0, 127, (n, n), dtype=torch.uint8)
    w_scale, w_zero = torch.full((n,), 0.01), torch.zeros(n, dtype=torch.int64)
    scale, zero = torch.tensor(0.1), torch.tensor(0)

    def call() -> Any:
        args: tuple[Any, ...] = (x, scale, zero, packed, w_scale, w_zero, None, 1.0, 0, torch.float32, "none", [], "")
        return ops.qlinear_pointwise.tensor(*args)

    return call


def matmul_peak(
    precision: str, device: torch.device | str = "cpu", size: int | None = None, budget_s: float = 0.1
) -> Peak:
    """Best rate of a large square matmul in ``precision``: int8 on oneDNN's int8 GEMM on CPU (the bf16 rate
    on CUDA). Without ``size``, the matrices grow from 256 until one product takes ``budget_s`` (or
    reaches 2048, 8192 on CUDA), so a dtype the hardware emulates slowly costs a second, not minutes."""
    device = torch.device(device)
    cap = 8192 if device.type == "cuda" else 2048
    n = size or 256
    while True:
        call, what = _matmul_call(precision, device, n)
        call()
        synchronize(device)
        times = []
        for _ in range(4 if device.type == "cpu" else 20):
            start = time.perf_counter()
            call()
            synchronize(device)
            times.append(time.perf_counter() - start)
        best = min(times)
        if size is not None or n >= cap or best >= budget_s:
            break
        n *= 2
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return Peak(precision, 2 * n**3 / best, "matmul", threads, f"{n}x{n}x{n} {what}")


def _matmul_call(precision: str, device: torch.device, n: int) -> tuple[Callable[[], Any], str]:
    if precision == "int8" and device.type == "cpu" and (gemm := _int8_gemm(n)) is not None:
        return gemm, "onednn u8s8"
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    note = " (int8 uses the bf16 rate)" if precision == "int8" else ""
    return (lambda: torch.mm(a, b, out=out)), f"{dtype}{note}"


def measure_peak(precision: str, device: torch.device | str = "cpu", threads: int | None = None) -> Peak:
    """The instruction peak when it can be measured here, else the large-matmul rate."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if torch.device(device).type == "cpu":
        peak = fma_loop_peak(precision, threads)
        if peak is not None:
            return peak
        if precision == "bf16" and (fp32 := fma_loop_peak("fp32", threads)) is not None:
            # no bf16 dot-product instruction: bf16 work runs on the fp32 FMA units at best
            detail = f"{fp32.detail}; no bf16 instructions on this CPU: its fp32 FMA rate"
            return Peak("bf16", fp32.flops, "fma-loop", fp32.threads, detail)
    return matmul_peak(precision, device)


# Vendor dense (no sparsity) peak rates in TFLOP/s, bf16 and fp32 (tf32 off), for GPUs a run may land on,
# keyed by (model, variant): both must be whole words of the device name (so "L40" is not "L4" or "L40S",
# and "H100 NVL" is not the SXM part); variant None is the model's default (SXM for H100/H200).
_GPU_SPEC_TFLOPS: dict[tuple[str, str | None], dict[str, float]] = {
    ("H200", "NVL"): {"bf16": 835.5, "fp32": 60.0},
    ("H200", None): {"bf16": 989.4, "fp32": 66.9},
    ("H100", "NVL"): {"bf16": 835.5, "fp32": 60.0},
    ("H100", "PCIE"): {"bf16": 756.0, "fp32": 51.2},
    ("H100", None): {"bf16": 989.4, "fp32": 66.9},  # SXM5
    ("A100", None): {"bf16": 312.0, "fp32": 19.5},
    ("L40S", None): {"bf16": 362.1, "fp32": 91.6},
    ("L40", None): {"bf16": 181.0, "fp32": 90.5},
    ("L4", None): {"bf16": 121.0, "fp32": 30.3},
}


def gpu_spec_peak(device_name: str, precision: str) -> Peak | None:
    """The vendor's dense peak for a known GPU (matched by whole words of its name), or None."""
    words = set(re.findall(r"[A-Z0-9]+", device_name.upper()))
    for (model, variant), rates in _GPU_SPEC_TFLOPS.items():  # ordered: variants before their model's default
        if model in words and (variant is None or variant in words) and precision in rates:
            name = f"{model} {variant}" if variant else model
            return Peak(precision, rates[precision] * 1e12, "vendor-spec", 1, f"{name} dense {precision}")
    return None
