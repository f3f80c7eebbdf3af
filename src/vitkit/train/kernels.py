"""Hand-written AVX-512 kernels for the training step's elementwise ops, written in C (``kernels.c``).

:func:`load` compiles them at first use (:mod:`vitkit.native`, cached per content) and returns a
:class:`vitkit.models.fused.TrainingKernels` that the trainer hands the model
(``VisionTransformer.set_training_kernels``); None where that is impossible (no C compiler, a CPU without
AVX-512 BF16, not Linux), and the model then keeps PyTorch's ops. They take bf16 CPU tensors only (what the
step runs under bf16 autocast); any other tensor goes through PyTorch's ops as before:

- GELU forward (exact, erf-based: erf as PyTorch's own, Abramowitz & Stegun 7.1.26, absolute error < 1.5e-7,
  but with Phi(h) for h < 0 computed directly rather than as 1 + erf, so the tail keeps its relative accuracy);
- GELU backward fused with the bias gradient: dh = dy gelu'(h) and db = sum over rows of dh in one pass
  (PyTorch: GELU backward, then the Linear's bias-gradient sum reading dh again);
- softmax over the attention probabilities' rows, in place (fp32 arithmetic). Its backward stays PyTorch's
  (a C version measured slower: BENCHMARKS.md).

Loaded from ``vitkit.train`` rather than from the model, since models sit below the layer that compiles
native code: the model only sees the interface.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from vitkit import native

FLAGS = (
    *("-fopenmp", "-fno-strict-aliasing"),
    *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"),
)
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma")
SOURCE = Path(__file__).with_name("kernels.c")
SOFTMAX_MAX = 4096  # the longest row vk_softmax_fwd takes (kernels.c)

_c_long, _c_int, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p


def _bf16_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


class CpuTrainingKernels:
    """The loaded C kernels as :class:`vitkit.models.fused.TrainingKernels`. ``gelu`` / ``softmax``: which
    of the two kinds to offer (both by default; one alone for A/B measurements)."""

    def __init__(self, lib: ctypes.CDLL, gelu: bool = True, softmax: bool = True) -> None:
        self.lib, self.use_gelu, self.use_softmax = lib, gelu, softmax
        signatures: dict[str, list[Any]] = {
            "vk_gelu_fwd": [_ptr, _ptr, _c_long, _c_int],
            "vk_gelu_bwd_bias": [_ptr, _ptr, _ptr, _ptr, _c_long, _c_int, _c_int],
            "vk_softmax_fwd": [_ptr, _c_long, _c_int, _c_long, _c_int],
        }
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = None if name == "vk_gelu_fwd" else ctypes.c_int

    def __deepcopy__(self, memo: dict[int, Any]) -> CpuTrainingKernels:
        return self  # stateless: a copied model shares the loaded library

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reload, (self.use_gelu, self.use_softmax))

    def gelu_supported(self, h: torch.Tensor) -> bool:
        return self.use_gelu and _bf16_cpu(h)

    def gelu(self, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        y = torch.empty_like(h)
        with torch.profiler.record_function("vitkit::gelu"):
            self.lib.vk_gelu_fwd(h.data_ptr(), y.data_ptr(), h.numel(), torch.get_num_threads())
        return y

    def gelu_backward_bias(self, grad: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad, h = grad.contiguous(), h.contiguous()
        if grad.shape != h.shape or h.dim() != 2:
            raise ValueError(f"GELU backward needs two (N, C) tensors of one shape, got {grad.shape} and {h.shape}")
        dh = torch.empty_like(h)
        db = torch.empty(h.shape[1], dtype=torch.float32)
        with torch.profiler.record_function("vitkit::gelu_backward_bias"):
            rc = self.lib.vk_gelu_bwd_bias(
                grad.data_ptr(), h.data_ptr(), dh.data_ptr(), db.data_ptr(), h.shape[0], h.shape[1],
                torch.get_num_threads(),
            )  # fmt: skip
        if rc != 0:
            raise MemoryError("the GELU backward kernel could not allocate its per-thread sums")
        return dh, db

    def softmax_supported(self, x: torch.Tensor) -> bool:
        return self.use_softmax and _bf16_cpu(x) and x.is_contiguous() and 0 < x.shape[-1] <= SOFTMAX_MAX

    def softmax_(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        with torch.profiler.record_function("vitkit::softmax"):
            rc = self.lib.vk_softmax_fwd(x.data_ptr(), x.numel() // n, n, n, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the softmax kernel takes rows of at most {SOFTMAX_MAX}, got {n}")
        return x


def load(gelu: bool = True, softmax: bool = True) -> CpuTrainingKernels | None:
    """The kernels compiled for this CPU, or None where they cannot run (see the module docstring)."""
    lib = native.load(SOURCE.read_text(), "vk_train", FLAGS, NEEDS)
    return None if lib is None else CpuTrainingKernels(lib, gelu, softmax)


def _reload(gelu: bool, softmax: bool) -> CpuTrainingKernels | None:
    return load(gelu, softmax)
