"""A hand-written int8 GEMM for the int8 inference fast path (AVX-512 VNNI, ``vpdpbusd``), written in C.

``Int8Linear`` runs its GEMM here, where the kernel can be built, instead of oneDNN's ``qlinear_pointwise``:
uint8 activations (a scale and zero point per tensor or per row) times int8 weights (symmetric, per output
channel), int32 accumulation, the epilogue in fp32 (bias; none, exact GELU, tanh GELU or a residual add) and a
bf16 output.
Weights are packed once (:func:`pack_weights`) into the kernel's operand layout: panels of ``panel`` columns,
in each the K/4 groups of 4 consecutive k, so that one zmm holds 16 columns x 4 k; K and N are padded with
zero weights. The zero point is taken out by ``zp * colsum(W)[n]`` per call (column sums precomputed).

Measured on the 2-core Zen 5 (BENCHMARKS.md, "A hand-written int8 GEMM"): faster than oneDNN's kernel on
every B/16 shape, most on the residual-add and GELU epilogues. The source is compiled at first use by the
system C compiler (:mod:`vitkit.native`, cached per content); :func:`load` returns None where that is
impossible (no compiler, no AVX512_VNNI / AVX512_BF16, not Linux), and ``Int8Linear`` keeps oneDNN there.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from vitkit import native

FLAGS = ("-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "fma")
SOURCE = Path(__file__).with_name("gemm_int8.c")
EPILOGUES = {"none": 0, "gelu": 1, "gelu_tanh": 2, "add": 3}
ROWS_PER_CHUNK = 512  # activation rows a thread keeps in L2 while it walks the weight panels (measured)
# the kernel's longest reduction: K <= 65536 keeps its int32 sums and zp * colsum below 2^31 (255 * 128 * K); a
# longer one (an MLP wider than 65536 feeding fc2; ViTConfig allows 262144) goes to oneDNN's GEMM instead
MAX_K = 1 << 16


class Int8Gemm:
    """The loaded kernel: ``gemm(q, scale, zero, packed, colsum, w_scale, bias, epilogue, other)`` -> bf16, with
    ``scale``/``zero`` one per tensor (0-dim) or one per row of ``q`` ((M,) float32 / int32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.vk_gemm_u8s8
        fn.restype = ctypes.c_int
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, i64, i32, i32, p, p, p, p, ctypes.c_float, ctypes.c_int32, i32, p, i64, p, i64, i64]
        fn.argtypes += [i32, p, p]
        self.fn = fn
        self.panel = int(lib.vk_gemm_int8_panel())

    def pack_weights(self, qweight: torch.Tensor) -> torch.Tensor:
        """int8 weights (N, K) -> the kernel's layout (N/panel, K/4, panel, 4), zero-padded, 64-byte aligned."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"pack_weights: int8 (N, K) weights expected, got {qweight.dtype} {tuple(qweight.shape)}")
        N, K = qweight.shape
        P, G = self.panel, -(-K // 4)
        Np = -(-N // P) * P
        w = torch.zeros(Np, G * 4, dtype=torch.int8)
        w[:N, :K] = qweight
        packed = w.view(Np // P, P, G, 4).permute(0, 2, 1, 3).contiguous()
        if packed.data_ptr() % 64:  # the kernel's aligned loads: over-allocate and take an aligned view
            flat = torch.empty(packed.numel() + 64, dtype=torch.int8)
            start = -flat.data_ptr() % 64
            flat[start : start + packed.numel()].view_as(packed).copy_(packed)
            packed = flat[start : start + packed.numel()].view_as(packed)
        return packed

    def unpack_weights(self, packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
        """The (N, K) int8 weights back from :meth:`pack_weights`' layout."""
        return packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 4)[:N, :K].contiguous()

    @staticmethod
    def takes(K: int) -> bool:
        """Whether the kernel takes a reduction of length ``K`` (1..``MAX_K``)."""
        return 1 <= K <= MAX_K

    def supports(self, q: torch.Tensor, other: torch.Tensor | None, dtype: torch.dtype) -> bool:
        """Whether these operands can go through the kernel: uint8 activations with contiguous rows on CPU and
        at most ``MAX_K`` columns, a bf16 output, a bf16 residual with contiguous rows (if any)."""
        ok = dtype == torch.bfloat16 and q.device.type == "cpu" and q.dtype == torch.uint8 and q.dim() == 2
        ok = ok and q.stride(1) == 1 and self.takes(q.shape[1])
        if other is not None:
            ok = ok and other.dtype == torch.bfloat16 and other.dim() == 2 and other.stride(1) == 1
            ok = ok and other.shape == (q.shape[0], other.shape[1]) and other.device.type == "cpu"
        return ok

    def __call__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        packed: torch.Tensor,
        colsum: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        epilogue: str,
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        M, K = q.shape
        N = colsum.shape[0]
        per_row = scale.dim() == 1  # a scale and zero point per row (float32, int32), else one per tensor
        if per_row and not (
            scale.shape == (M,) == zero.shape
            and scale.dtype == torch.float32
            and zero.dtype == torch.int32
            and scale.is_contiguous()
            and zero.is_contiguous()
        ):
            raise ValueError(f"Int8Gemm: per-row scales and zero points must be ({M},) float32 and int32")
        if packed.numel() != -(-N // self.panel) * self.panel * -(-K // 4) * 4:
            raise ValueError(f"Int8Gemm: packed weights of {packed.numel()} bytes do not fit N={N}, K={K}")
        if epilogue == "add" and (other is None or other.shape != (M, N)):
            raise ValueError(f"Int8Gemm: the residual must be ({M}, {N})")
        out = torch.empty(M, N, dtype=torch.bfloat16)
        # a named op in profiles, with its shape (benchmarks/profile_inference.py sorts GEMMs by it)
        with torch.profiler.record_function(f"vitkit::gemm_u8s8 M={M} K={K} N={N} {epilogue}"):
            rc = self.fn(
                q.data_ptr(), q.stride(0), M, K, N, packed.data_ptr(), colsum.data_ptr(), w_scale.data_ptr(),
                None if bias is None else bias.data_ptr(), 1.0 if per_row else float(scale),
                0 if per_row else int(zero), EPILOGUES[epilogue],
                None if other is None else other.data_ptr(), 0 if other is None else other.stride(0),
                out.data_ptr(), N, ROWS_PER_CHUNK, torch.get_num_threads(),
                scale.data_ptr() if per_row else None, zero.data_ptr() if per_row else None,
            )  # fmt: skip
        if rc != 0:
            raise ValueError(f"the int8 GEMM kernel refused its arguments (M={M}, K={K}, N={N}, {epilogue})")
        return out


def load() -> Int8Gemm | None:
    """The int8 GEMM kernel, or None where it cannot run (no AVX512_VNNI/BF16, no C compiler, not Linux)."""
    lib = native.load(native.kernel_source(SOURCE), "vk_gemm_int8", FLAGS, NEEDS)
    return None if lib is None else Int8Gemm(lib)
