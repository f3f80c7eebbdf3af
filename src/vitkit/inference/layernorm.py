"""LayerNorm of bf16 rows in C for the bf16 inference fast path (AVX-512 BF16): ``NativeLayerNorm``.

``layernorm.c``: one pass for the row mean, one for the variance (the row stays in L1), one for the output; the
statistics and y = (x - mean) * rstd * gamma + beta in fp32, rounded to bf16 once; rows split over torch's
OpenMP pool. PyTorch's bf16 LayerNorm computes the same in fp32 (so the two agree to a bf16 rounding step);
the kernel saves its per-call overhead and runs closer to memory speed on the fast path's (B*T, D) tokens
(BENCHMARKS.md). Compiled at first use (:mod:`vitkit.native`); :func:`load` returns None where it cannot run (no
compiler, no AVX512_BF16, not Linux) and ``NativeLayerNorm`` then calls the module it wraps.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from vitkit import native

FLAGS = ("-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
SOURCE = Path(__file__).with_name("layernorm.c")


def load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``vk_layernorm_bf16`` compiled for this CPU, or None where it cannot run."""
    lib = native.load(native.kernel_source(SOURCE), "vk_layernorm", FLAGS, NEEDS)
    if lib is None:
        return None
    fn = lib.vk_layernorm_bf16
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [p, i64, i64, i64, p, p, ctypes.c_float, p, i64, ctypes.c_int]
    return fn


class LayerNormRows(nn.Module):
    """A LayerNorm whose rows a C kernel reads: ``norm`` itself (the fallback), its scale and shift as
    contiguous fp32 buffers (ones and zeros where it has none), and ``takes(x)``: whether ``x`` is what the
    kernels read -- bf16 CPU (rows, D) with unit column stride and rows at least D apart. The base of
    ``NativeLayerNorm`` and of the int8 path's ``LayerNormQuantize``."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm
        D = norm.normalized_shape[-1]
        weight = torch.ones(D) if norm.weight is None else norm.weight.detach().float()
        bias = torch.zeros(D) if norm.bias is None else norm.bias.detach().float()
        self.gamma: torch.Tensor
        self.beta: torch.Tensor
        self.register_buffer("gamma", weight.contiguous(), persistent=False)
        self.register_buffer("beta", bias.contiguous(), persistent=False)

    def takes(self, x: torch.Tensor) -> bool:
        D = self.gamma.shape[0]
        return (
            len(self.norm.normalized_shape) == 1
            and x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[1] == D
            and x.stride(1) == 1
            and x.stride(0) >= D
        )


class NativeLayerNorm(LayerNormRows):
    """``norm(x)`` (a LayerNorm over the last dimension) by the C kernel for the rows it ``takes``; anything
    else, or ``kernel`` None, goes to ``norm`` itself."""

    def __init__(self, norm: nn.LayerNorm, kernel: ctypes._CFuncPtr | None) -> None:  # type: ignore[name-defined]
        super().__init__(norm)
        self.fn = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = self.gamma.shape[0]
        if self.fn is None or not self.takes(x):
            return self.norm(x)
        y = torch.empty(x.shape, dtype=x.dtype)
        with torch.profiler.record_function("vitkit::layernorm_bf16"):
            rc = self.fn(x.data_ptr(), x.shape[0], D, x.stride(0), self.gamma.data_ptr(), self.beta.data_ptr(),
                         float(self.norm.eps), y.data_ptr(), D, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"the LayerNorm kernel refused its arguments (rc={rc}, {tuple(x.shape)})")
        return y
