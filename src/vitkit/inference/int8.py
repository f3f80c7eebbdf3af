"""Int8 linear layers of the inference fast path: VNNI GEMMs on dynamically quantised activations.

Weights are quantised once (symmetric int8, per output channel) and pre-packed, for the C kernel of
:mod:`vitkit.inference.gemm_int8` where it loads, else for oneDNN's ``qlinear_pointwise``; activations are quantised
per call (uint8, per tensor, from their own min and max). The activation quantiser is, by preference, a C
kernel (``quantize.c``, AVX-512, compiled at first use by :mod:`vitkit.native`: min/max and quantise in two
passes of one OpenMP region on torch's thread pool), else the same formula compiled by inductor, else eager.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vitkit import hardware, native
from vitkit.inference.gemm_int8 import Int8Gemm
from vitkit.inference.layernorm import LayerNormRows

QUANTIZE_FLAGS = ("-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl")
QUANTIZE_NEEDS = ("avx512f", "avx512bw", "avx512vl")
QUANTIZE_SOURCE = Path(__file__).with_name("quantize.c")


def quantize_dynamic_u8(x: torch.Tensor, qmax: int = 255) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor asymmetric uint8 quantisation of activations x (M, K) from their own min and max.

    Returns (q (M, K) uint8 in [0, qmax], scale (), zero point () int64) with x ~= (q - zero_point) * scale;
    the range always contains 0 so that zero is exact.
    """
    lo, hi = torch.aminmax(x)
    lo, hi = lo.float().clamp(max=0.0), hi.float().clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp(min=1e-8)
    zero_point = torch.round(-lo / scale)
    q = torch.clamp(torch.round(x.float() / scale) + zero_point, 0, qmax).to(torch.uint8)
    return q, scale, zero_point.to(torch.int64)


def quantize_dynamic_u7(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_dynamic_u8`` into 7 bits ([0, 127]): without VNNI, x86 int8 GEMMs multiply u8 x s8 pairs
    with ``vpmaddubsw``, whose int16 sums saturate for full-range inputs (255 * 127 * 2 > 32767); 7-bit
    activations cannot overflow (fbgemm's ``reduce_range``). Measured on an AVX2 CPU: 15% relative error of
    a full-range fp32-output GEMM, 1.5% with 7 bits."""
    return quantize_dynamic_u8(x, 127)


Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def default_quantizer() -> Quantizer:
    """Full-range uint8 activations where the CPU has VNNI, 7-bit ones where it does not."""
    return quantize_dynamic_u8 if hardware.has_vnni() else quantize_dynamic_u7


class CompiledQuantizer:
    """An activation quantiser compiled by inductor into one fused pass (eager it is ~6 passes and, for the
    MLP's wide activation, slower than the int8 GEMM it feeds). Falls back to eager where inductor cannot
    compile (no C++ compiler)."""

    def __init__(self, fn: Quantizer) -> None:
        self.eager = fn
        self.fn: Quantizer = torch.compile(fn)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            return self.fn(x)
        except RuntimeError:  # dynamo/inductor failures (e.g. no compiler) subclass RuntimeError
            if self.fn is self.eager:
                raise
            self.fn = self.eager
            return self.fn(x)


def _run_quantizer(
    fn: Callable[..., int], region: str, shape: torch.Size, qmax: int, *head: object, per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Call a quantising C kernel of ``quantize.c`` -- ``fn(*head, q, scale, zero, qmax, threads)``, the outputs
    last -- with fresh outputs: codes of ``shape`` (uint8), the scale and the zero point (0-dim float32 and int64,
    or with ``per_row`` one per row of ``shape``, float32 and int32); a named op in profiles."""
    q = torch.empty(shape, dtype=torch.uint8)
    if per_row:
        scale, zero = torch.empty(shape[0], dtype=torch.float32), torch.empty(shape[0], dtype=torch.int32)
    else:
        scale, zero = torch.empty((), dtype=torch.float32), torch.empty((), dtype=torch.int64)
    with torch.profiler.record_function(region):
        rc = fn(*head, q.data_ptr(), scale.data_ptr(), zero.data_ptr(), qmax, torch.get_num_threads())
    if rc != 0:
        raise ValueError(
            f"the quantisation kernel {region} refused its arguments (rc={rc}, {tuple(shape)}, qmax={qmax})"
        )
    return q, scale, zero


class NativeQuantizer:
    """``quantize_dynamic_u8`` (``qmax`` 255, or 127 for ``quantize_dynamic_u7``) of contiguous bf16 CPU
    activations by the C kernel; other inputs go to ``fallback``."""

    def __init__(self, lib: ctypes.CDLL, qmax: int, fallback: Quantizer) -> None:
        fn = lib.vk_quantize_u8
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, ctypes.c_int, ctypes.c_int]
        self.fn, self.qmax, self.fallback = fn, qmax, fallback
        ln = lib.vk_layernorm_u8  # LayerNorm fused with the quantiser (LayerNormQuantize)
        ln.restype = ctypes.c_int
        ln.argtypes = [p, i64, i64, i64, p, p, ctypes.c_float, p, p, p, ctypes.c_int, ctypes.c_int]
        self.layernorm = ln
        rows = lib.vk_quantize_rows_u8  # per row: a scale and zero point for each (per_row)
        rows.restype = ctypes.c_int
        rows.argtypes = [p, i64, i64, i64, p, p, p, ctypes.c_int, ctypes.c_int]
        self.rows_fn = rows

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not x.is_contiguous():
            return self.fallback(x)
        return _run_quantizer(self.fn, "vitkit::quantize_u8", x.shape, self.qmax, x.data_ptr(), x.numel())

    def per_row(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize_dynamic_u8`` of each row of x (M, K) on its own: codes (M, K) uint8, scales (M,) float32,
        zero points (M,) int32 (the VNNI GEMM's per-row operands). One pass from memory per row, no barrier
        between threads; each row's range is at most the tensor's, so its step is too. bf16 CPU rows only."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError("per-row quantisation takes bf16 CPU rows (M, K) with contiguous rows")
        M, K = x.shape
        head = (x.data_ptr(), M, K, x.stride(0))
        return _run_quantizer(self.rows_fn, "vitkit::quantize_rows_u8", x.shape, self.qmax, *head, per_row=True)


def load_native_quantizer(qmax: int, fallback: Quantizer) -> NativeQuantizer | None:
    """The C quantiser into [0, ``qmax``], or None where it cannot run (no AVX-512, no C compiler)."""
    lib = native.load(native.kernel_source(QUANTIZE_SOURCE), "vk_quantize", QUANTIZE_FLAGS, QUANTIZE_NEEDS)
    return None if lib is None else NativeQuantizer(lib, qmax, fallback)


class LayerNormQuantize(LayerNormRows):
    """``quantize(norm(x))`` -- a LayerNorm whose output feeds an ``Int8Linear`` -- in one C kernel for
    contiguous bf16 CPU rows (``vk_layernorm_u8`` in ``quantize.c``): mean, rstd and the min/max of the
    normalised output in one pass, the codes in a second, with no bf16 LayerNorm output written or read back.
    The output is quantised in fp32, before the bf16 rounding the two-step path applies, so codes may differ
    from ``quantize(norm(x))`` by one step. Other inputs, or no ``native`` quantiser, take the two steps."""

    def __init__(self, norm: nn.LayerNorm, quantize: Quantizer, native: NativeQuantizer | None) -> None:
        super().__init__(norm)
        self.quantize = quantize
        self.fn = None if native is None else native.layernorm
        self.qmax = 255 if native is None else native.qmax

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fn is None or not self.takes(x):
            return self.quantize(self.norm(x))
        M, D, eps = x.shape[0], x.shape[1], float(self.norm.eps)
        head = (x.data_ptr(), M, D, x.stride(0), self.gamma.data_ptr(), self.beta.data_ptr(), eps)
        return _run_quantizer(self.fn, "vitkit::layernorm_u8", x.shape, self.qmax, *head)


def fast_quantizer() -> Quantizer:
    """The fastest activation quantiser here: the C kernel (bf16 inputs; others through the compiled one) where
    the CPU has AVX-512 and a C compiler is present, else ``default_quantizer()`` compiled by inductor. The C
    kernel: 0.36 ms against 0.66 ms compiled for B/16's (6304, 768) bf16 activations, +2-6% int8 end to end
    (BENCHMARKS.md)."""
    fn = default_quantizer()
    compiled = CompiledQuantizer(fn)
    return load_native_quantizer(127 if fn is quantize_dynamic_u7 else 255, compiled) or compiled


def has_onednn_int8() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear kernels (x86 CPUs)."""
    return hardware.has_onednn_linear() and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8Linear(nn.Module):
    """An int8 Linear: weights quantised once (symmetric, per output channel), activations quantised per call
    (uint8, per tensor, from their min/max: dynamic quantisation); int32 accumulation, bias and the epilogue
    (GELU, residual add) fused, output in ``dtype``. The GEMM is ``gemm`` (the VNNI kernel of
    :mod:`vitkit.inference.gemm_int8`, weights packed for it) for bf16 outputs where given, else oneDNN's
    ``qlinear_pointwise`` (weights pre-packed for ``rows`` rows; for ``gemm``'s layer, only when an input
    the kernel does not take comes). ``quantize`` is the activation quantiser (default:
    ``default_quantizer()``, or a compiled copy)."""

    def __init__(
        self,
        linear: nn.Linear,
        dtype: torch.dtype,
        epilogue: str = "none",
        rows: int | None = None,
        quantize: Quantizer | None = None,
        gemm: Int8Gemm | None = None,
    ) -> None:
        super().__init__()
        if epilogue not in ("none", "gelu", "gelu_tanh", "add"):
            raise ValueError(f"unknown epilogue {epilogue!r}")
        self.epilogue, self.dtype, self.rows = epilogue, dtype, rows
        self.quantize = quantize or default_quantizer()
        self.fuse_add = True  # oneDNN has no fused residual add into bf16 on CPUs without AVX-512
        w = linear.weight.detach().float()  # (N, K)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (N,)
        qw = torch.clamp(torch.round(w / scale[:, None]), -128, 127).to(torch.int8)
        self.w_scale: torch.Tensor
        self.w_zero: torch.Tensor
        self.bias: torch.Tensor | None
        # the VNNI kernel for bf16 outputs and the reductions it takes (K <= 65536), else oneDNN's
        self.gemm = gemm if dtype == torch.bfloat16 and gemm is not None and gemm.takes(qw.shape[1]) else None
        self._onednn: torch.Tensor | None = None  # oneDNN's pre-packed weights, made when first needed
        self.weight_shape = tuple(qw.shape)  # (N, K)
        self.packed: torch.Tensor | None
        self.colsum: torch.Tensor | None
        packed = colsum = None
        if self.gemm is not None:
            packed = self.gemm.pack_weights(qw)
            colsum = qw.sum(dim=1, dtype=torch.int32)  # (N,): the zero point's share, zp * colsum
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("colsum", colsum, persistent=False)
        if self.gemm is None:
            self._onednn = torch.ops.onednn.qlinear_prepack(qw, [rows or 1, qw.shape[1]])
        self.register_buffer("w_scale", scale, persistent=False)
        self.register_buffer("w_zero", torch.zeros_like(scale, dtype=torch.int64), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def onednn_weight(self) -> torch.Tensor:
        """The weights pre-packed for oneDNN. A layer of the C kernel keeps only the kernel's packing (one copy
        of the int8 weights, not two) and makes oneDNN's from it at the first input the kernel does not take."""
        if self._onednn is None:
            assert self.gemm is not None and self.packed is not None
            qw = self.gemm.unpack_weights(self.packed, *self.weight_shape)
            self._onednn = torch.ops.onednn.qlinear_prepack(qw, [self.rows or 1, qw.shape[1]])
        return self._onednn

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        q, scale, zero = self.quantize(x)
        return self.forward_quantized(q, scale, zero, other)

    def forward_quantized(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, other: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``forward`` of activations quantised already (``q`` uint8 (M, K), per-tensor ``scale`` and ``zero``
        point, as the quantiser returns them; or per row, ``NativeQuantizer.per_row``, for the VNNI GEMM only): for a
        quantiser fused into what precedes (``LayerNormQuantize``) or chosen by the caller."""
        if self.gemm is not None and self.gemm.supports(q, other, self.dtype):
            assert self.packed is not None and self.colsum is not None
            return self.gemm(q, scale, zero, self.packed, self.colsum, self.w_scale, self.bias, self.epilogue, other)
        if scale.dim():
            raise ValueError("per-row activation scales need the VNNI GEMM kernel (oneDNN's takes one per tensor)")
        args = (q, scale, zero, self.onednn_weight(), self.w_scale, self.w_zero)
        if self.epilogue == "add" and self.fuse_add:
            try:
                return torch.ops.onednn.qlinear_pointwise.binary_tensor(
                    *args[:6], other, self.bias, 1.0, 0, self.dtype, 1.0, 0, "add", 1.0, "none", [], ""
                )
            except RuntimeError:  # "could not create a primitive descriptor": add after the GEMM instead
                self.fuse_add = False
        if self.epilogue == "add":
            assert other is not None
            y = torch.ops.onednn.qlinear_pointwise.tensor(*args, self.bias, 1.0, 0, self.dtype, "none", [], "")
            return y.add_(other)
        post, algo = (
            ("none", "") if self.epilogue == "none" else ("gelu", "tanh" if "tanh" in self.epilogue else "none")
        )
        return torch.ops.onednn.qlinear_pointwise.tensor(*args, self.bias, 1.0, 0, self.dtype, post, [], algo)
