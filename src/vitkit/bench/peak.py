"""The machine's peak arithmetic rate, measured in the same run as the benchmark it scales.

Two ways, tried in order, and the result always says which one it is:

- ``"fma-loop"`` (CPU): a tiny C kernel of independent vector multiply-adds (512-bit ``vfmadd`` for fp32,
  or 256-bit on AVX2-only CPUs; ``vdpbf16ps`` for bf16, ``vpdpbusd`` for int8), compiled at run time with
  the system C compiler (``vitkit.native``, cached per content) and called through ctypes on every core at
  once. This is the instruction-throughput ceiling: no real program beats it, and large GEMMs reach 70-90% of it. A CPU
  without bf16 instructions gets its fp32 FMA rate as the bf16 peak (bf16 work cannot run faster there).
- ``"amx-matmul"`` (CPUs with AMX tiles for the precision): oneDNN's GEMMs at the model's own shapes, where
  they beat the vector loop (AMX multiplies bf16/int8 matrices several times faster than AVX-512 can).
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vitkit import hardware, native
from vitkit.timing import synchronize

# Each kernel runs `iters` rounds of 12 or 24 independent multiply-adds (accumulator chains) on vector
# registers; enough chains cover the instruction's latency so that the loop is throughput-bound. How many are
# enough depends on the CPU: on Zen 5 (family 26) `vdpbf16ps` needs more than 12 -- 12 chains read 8-11% below
# 24 (1001-1010 against 1079-1118 GFLOP/s, 2026-11-24) -- while 24 chains of `vpdpbusd` read lower than 12 there.
# So every variant the CPU can run is measured and the fastest is the peak. 24 chains fit AVX-512's 32 registers
# with the two operands; AVX2 has 16, so its loop keeps 12. Each returns a value derived from every accumulator
# so that nothing is optimised away.
_C_SOURCE = r"""
#include <immintrin.h>
// 12 chains named p0..p11; distinct starting values (identical accumulators would be merged by the compiler)
#define ROUND12(OP, p) \
    p##0 = OP(p##0, x, y); p##1 = OP(p##1, x, y); p##2 = OP(p##2, x, y); p##3 = OP(p##3, x, y); \
    p##4 = OP(p##4, x, y); p##5 = OP(p##5, x, y); p##6 = OP(p##6, x, y); p##7 = OP(p##7, x, y); \
    p##8 = OP(p##8, x, y); p##9 = OP(p##9, x, y); p##10 = OP(p##10, x, y); p##11 = OP(p##11, x, y);
#define INIT12(T, SET, p, o) T p##0 = SET(o + 0), p##1 = SET(o + 1), p##2 = SET(o + 2), p##3 = SET(o + 3), \
    p##4 = SET(o + 4), p##5 = SET(o + 5), p##6 = SET(o + 6), p##7 = SET(o + 7), p##8 = SET(o + 8), \
    p##9 = SET(o + 9), p##10 = SET(o + 10), p##11 = SET(o + 11);
#define SUM12(ADD, p) ADD(ADD(ADD(ADD(p##0, p##1), ADD(p##2, p##3)), ADD(ADD(p##4, p##5), ADD(p##6, p##7))), \
    ADD(ADD(p##8, p##9), ADD(p##10, p##11)))
// A kernel of 12 chains (a) or 24 (a and b): NAME(iters, seed), operands x and y set up by SETUP.
#define KERNEL12(NAME, T, SETUP, SET, OP, ADD, REDUCE) double NAME(long iters, float seed) { \
    SETUP INIT12(T, SET, a, 0) \
    for (long i = 0; i < iters; i++) { ROUND12(OP, a) } \
    return (double)REDUCE(SUM12(ADD, a)); }
#define KERNEL24(NAME, T, SETUP, SET, OP, ADD, REDUCE) double NAME(long iters, float seed) { \
    SETUP INIT12(T, SET, a, 0) INIT12(T, SET, b, 12) \
    for (long i = 0; i < iters; i++) { ROUND12(OP, a) ROUND12(OP, b) } \
    return (double)REDUCE(ADD(SUM12(ADD, a), SUM12(ADD, b))); }

#ifdef VK_AVX2
static float red256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#define SETUP_256 __m256 x = _mm256_set1_ps(seed), y = _mm256_set1_ps(1.0f - 1e-7f);
#define SET_PS256(i) _mm256_set1_ps(seed + (float)(i))
#define FMA_PS256(a, x, y) _mm256_fmadd_ps(x, y, a)
KERNEL12(vk_fp32_avx2, __m256, SETUP_256, SET_PS256, FMA_PS256, _mm256_add_ps, red256)
#endif

#ifdef VK_AVX512
#define SET_PS(i) _mm512_set1_ps(seed + (float)(i))
#define SETUP_FP32 __m512 x = _mm512_set1_ps(seed), y = _mm512_set1_ps(1.0f - 1e-7f);
#define FMA_PS(a, x, y) _mm512_fmadd_ps(x, y, a)
KERNEL12(vk_fp32, __m512, SETUP_FP32, SET_PS, FMA_PS, _mm512_add_ps, _mm512_reduce_add_ps)
KERNEL24(vk_fp32_x24, __m512, SETUP_FP32, SET_PS, FMA_PS, _mm512_add_ps, _mm512_reduce_add_ps)
#endif

#ifdef VK_BF16
#define SETUP_BF16 __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(seed)); \
    __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(1e-7f));
#define DP_BF16(a, x, y) _mm512_dpbf16_ps(a, x, y)
KERNEL12(vk_bf16, __m512, SETUP_BF16, SET_PS, DP_BF16, _mm512_add_ps, _mm512_reduce_add_ps)
KERNEL24(vk_bf16_x24, __m512, SETUP_BF16, SET_PS, DP_BF16, _mm512_add_ps, _mm512_reduce_add_ps)
#endif

#ifdef VK_VNNI
#define SETUP_INT8 __m512i x = _mm512_set1_epi8((char)(int)seed), y = _mm512_set1_epi8(1);
#define SET_EPI(i) _mm512_set1_epi32(i)
#define DP_U8(a, x, y) _mm512_dpbusd_epi32(a, x, y)
KERNEL12(vk_int8, __m512i, SETUP_INT8, SET_EPI, DP_U8, _mm512_add_epi32, _mm512_reduce_add_epi32)
KERNEL24(vk_int8_x24, __m512i, SETUP_INT8, SET_EPI, DP_U8, _mm512_add_epi32, _mm512_reduce_add_epi32)
#endif
"""

# Per precision, the kernels this CPU may run: (symbol, CPU flags it needs, FLOPs or int OPs of one
# instruction = lanes x products per lane x 2, accumulator chains). The fastest one measured is the peak;
# the AVX2 kernel is measured only where AVX-512 is absent (it cannot be the faster one).
_KERNELS = {
    "fp32": (
        ("vk_fp32", ("avx512f",), 16 * 1 * 2, 12),
        ("vk_fp32_x24", ("avx512f",), 16 * 1 * 2, 24),
        ("vk_fp32_avx2", ("avx2", "fma"), 8 * 1 * 2, 12),
    ),
    "bf16": (
        ("vk_bf16", ("avx512f", "avx512_bf16"), 16 * 2 * 2, 12),
        ("vk_bf16_x24", ("avx512f", "avx512_bf16"), 16 * 2 * 2, 24),
    ),
    "int8": (
        ("vk_int8", ("avx512f", "avx512_vnni"), 16 * 4 * 2, 12),
        ("vk_int8_x24", ("avx512f", "avx512_vnni"), 16 * 4 * 2, 24),
    ),
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
    """Instruction peak of this CPU for ``precision`` on ``threads`` cores: the fastest of its loops (12 and
    24 accumulator chains); None if it cannot be measured (no compiler, or no instruction for ``precision``:
    bf16 without AVX512_BF16, int8 without VNNI)."""
    flags = hardware.cpu_flags()
    usable = [k for k in _KERNELS[precision] if set(k[1]) <= flags]
    if "avx512f" in flags:
        usable = [k for k in usable if "avx2" not in k[1]]
    lib = _build_kernels(flags) if usable else None
    usable = [k for k in usable if lib is not None and hasattr(lib, k[0])]
    if lib is None or not usable:
        return None
    threads = threads or torch.get_num_threads()
    rates = []
    for symbol, _, ops_per_instr, chains in usable:
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_float]
        iters = 100_000
        while (elapsed := _run_threads(fn, iters, 1)) < 0.05:  # calibrate one thread to ~50 ms
            iters *= 4
        iters = max(int(iters * seconds / len(usable) / 5 / elapsed), 1)
        best = min(_run_threads(fn, iters, threads) for _ in range(5))
        rates.append((chains * ops_per_instr * iters * threads / best, symbol, chains))
    rates.sort(reverse=True)
    flops, symbol, chains = rates[0]
    # the other loops' rates too: fractions of an earlier 12-chain-only peak can be compared in the same run
    others = "".join(f"; {c} chains: {r / 1e9:.0f} G" for r, _, c in rates[1:])
    return Peak(precision, flops, "fma-loop", threads, f"{symbol}: {chains} chains{others}")


def _int8_gemm(n: int, m: int | None = None, k: int | None = None) -> Callable[[], Any] | None:
    """One (m, k) x (k, n) int8 GEMM on oneDNN's kernels (u8 activations, s8 weights; m = k = n by default), or
    None."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return None
    m, k = m or n, k or n
    packed = ops.qlinear_prepack(torch.randint(-100, 100, (n, k), dtype=torch.int8), [m, k])
    x = torch.randint(0, 127, (m, k), dtype=torch.uint8)
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
        best = min(_timed(call, device) for _ in range(4 if device.type == "cpu" else 20))
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


# The tile instructions that multiply matrices beyond the vector units' rate, per precision: where the CPU has
# them, the vector-loop "peak" is not one (an AMX Xeon's bf16 GEMMs ran at 440-529% of it)
_TILE_FLAGS = {"bf16": "amx_bf16", "int8": "amx_int8"}


def gemm_peak(precision: str, shapes: Sequence[tuple[int, int, int]], repeats: int = 3) -> Peak:
    """The best rate of oneDNN's CPU GEMMs (through PyTorch: AMX tiles where the CPU has them) over ``shapes``,
    (M, K, N) products such as a model's own layers at its batch; best of ``repeats`` per shape."""
    best, where = 0.0, ""
    for m, k, n in shapes:
        call, what = _gemm_call(precision, m, k, n)
        call()  # oneDNN builds its primitive
        t = min(_timed(call, torch.device("cpu")) for _ in range(repeats))
        if 2 * m * k * n / t > best:
            best, where = 2 * m * k * n / t, f"{m}x{k}x{n} {what}"
    return Peak(precision, best, "amx-matmul", torch.get_num_threads(), f"best of the model's GEMMs: {where}")


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def _gemm_call(precision: str, m: int, k: int, n: int) -> tuple[Callable[[], Any], str]:
    if precision == "int8" and (gemm := _int8_gemm(n, m, k)) is not None:
        return gemm, "onednn u8s8"
    a = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    return (lambda: torch.nn.functional.linear(a, w)), "torch.bfloat16"


def measure_peak(
    precision: str,
    device: torch.device | str = "cpu",
    threads: int | None = None,
    gemm_shapes: Sequence[tuple[int, int, int]] = (),
) -> Peak:
    """The instruction peak when it can be measured here, else the large-matmul rate. On a CPU with tile
    instructions for ``precision`` (AMX), the denominator is what the machine's fastest GEMMs reach: the better of
    the vector loop and oneDNN's GEMMs at ``gemm_shapes`` (the model's own), method ``"amx-matmul"`` when those
    win."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if torch.device(device).type == "cpu":
        peak = fma_loop_peak(precision, threads)
        tile = _TILE_FLAGS.get(precision)
        if gemm_shapes and tile is not None and tile in hardware.cpu_flags():
            tiles = gemm_peak(precision, gemm_shapes)
            if peak is None or tiles.flops > peak.flops:
                return tiles
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
