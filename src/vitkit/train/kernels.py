"""Hand-written AVX-512 kernels for the training step's elementwise ops, written in C (``kernels.c``).

:func:`load` compiles them at first use (:mod:`vitkit.native`, cached per content) and returns a
:class:`vitkit.models.fused.TrainingKernels` that the trainer hands the model
(``vitkit.models.kernel_paths.set_training_kernels``); None where that is impossible (no C compiler, a CPU without
AVX-512 BF16, not Linux), and the model then keeps PyTorch's ops. They take bf16 CPU tensors only (what the
step runs under bf16 autocast); any other tensor goes through PyTorch's ops as before:

- GELU forward (exact, erf-based: erf as PyTorch's own, Abramowitz & Stegun 7.1.26, absolute error < 1.5e-7,
  but with Phi(h) for h < 0 computed directly rather than as 1 + erf, so the tail keeps its relative accuracy);
- GELU backward fused with the bias gradient: dh = dy gelu'(h) and db = sum over rows of dh in one pass
  (PyTorch: GELU backward, then the Linear's bias-gradient sum reading dh again);
- softmax over the attention probabilities' rows, in place (fp32 arithmetic). Its backward stays PyTorch's
  (a C version measured slower: BENCHMARKS.md);
- the whole attention, forward and backward (``attention.c``, a library of its own): per (image, head), q, k
  and v read from the fused projection (B, T, 3D), scores, softmax and P v with ``vdpbf16ps`` (bf16 products,
  fp32 sums), P kept in bf16 for the backward pass, the output written in the token layout (B, T, D); the
  backward writes dq, dk and dv straight into the projection's gradient (B, T, 3D).

With them the Linear layers' forward and input-gradient GEMMs (bf16) run through oneDNN's
``_linear_pointwise`` on the weight reordered for it (``_reorder_linear_weight``) once per pass, where this
PyTorch has oneDNN's bf16 linear (``hardware.has_onednn_linear``).

Loaded from ``vitkit.train`` rather than from the model, since models sit below the layer that compiles
native code: the model only sees the interface.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from vitkit import hardware, native

FLAGS = (
    *("-fopenmp", "-fno-strict-aliasing"),
    *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"),
)
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma")
SOURCE = Path(__file__).with_name("kernels.c")
ATTENTION_SOURCE = Path(__file__).with_name("attention.c")
SOFTMAX_MAX = 4096  # the longest row vk_softmax_fwd takes (kernels.c)
ATTENTION_T_MAX, ATTENTION_D_MAX = 4096, 256  # the most tokens and the widest head attention.c takes

_c_long, _c_int, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p


def _bf16_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


class CpuTrainingKernels:
    """The loaded C kernels as :class:`vitkit.models.fused.TrainingKernels`. ``gelu`` / ``softmax`` /
    ``attention``: which kinds to offer (all by default; fewer for A/B measurements). ``attention_lib``: the
    compiled ``attention.c``, None where it is not (the attention then runs its softmax through ``softmax_``)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        gelu: bool = True,
        softmax: bool = True,
        attention_lib: ctypes.CDLL | None = None,
        linear: bool = True,
    ) -> None:
        self.lib, self.use_gelu, self.use_softmax = lib, gelu, softmax
        self.use_linear = linear and hardware.has_onednn_linear(torch.bfloat16)
        self.attention_lib = attention_lib
        if attention_lib is not None:
            attention_lib.vk_attn_fwd.argtypes = [_ptr, _ptr, _ptr, *[_c_int] * 4, ctypes.c_float, _c_int]
            attention_lib.vk_attn_bwd.argtypes = [*[_ptr] * 4, *[_c_int] * 4, ctypes.c_float, _c_int]
            attention_lib.vk_attn_fwd.restype = attention_lib.vk_attn_bwd.restype = ctypes.c_int
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
        return (load, (self.use_gelu, self.use_softmax, self.attention_lib is not None, self.use_linear))

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

    def linear_supported(self, x: torch.Tensor) -> bool:
        return self.use_linear and _bf16_cpu(x)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # oneDNN's GEMM on the weight reordered into its blocked layout for x's rows: ~1.2x the rate of aten's
        # mm / addmm on the plain weight (which oneDNN would reorder inside every call, or not at all)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def softmax_supported(self, x: torch.Tensor) -> bool:
        return self.use_softmax and _bf16_cpu(x) and x.is_contiguous() and 0 < x.shape[-1] <= SOFTMAX_MAX

    def softmax_(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        with torch.profiler.record_function("vitkit::softmax"):
            rc = self.lib.vk_softmax_fwd(x.data_ptr(), x.numel() // n, n, n, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the softmax kernel takes rows of at most {SOFTMAX_MAX}, got {n}")
        return x

    def attention_supported(self, qkv: torch.Tensor, num_heads: int) -> bool:
        if self.attention_lib is None or not _bf16_cpu(qkv) or qkv.dim() != 3 or num_heads <= 0:
            return False
        B, T, three_d = qkv.shape
        d = three_d // (3 * num_heads)
        return (
            qkv.is_contiguous()
            and three_d == 3 * num_heads * d
            and d % 2 == 0
            and 0 < d <= ATTENTION_D_MAX
            and 0 < T <= ATTENTION_T_MAX
            and B > 0
        )

    def _check(self, qkv: torch.Tensor, num_heads: int) -> tuple[int, int, int]:
        if not self.attention_supported(qkv, num_heads):
            raise ValueError(
                f"the attention kernel takes a contiguous bf16 CPU (B, T, 3 h d) tensor with an even d <= "
                f"{ATTENTION_D_MAX} and T <= {ATTENTION_T_MAX}, got {tuple(qkv.shape)} {qkv.dtype} for "
                f"{num_heads} heads"
            )
        B, T, three_d = qkv.shape
        return B, T, three_d // (3 * num_heads)

    def attention(self, qkv: torch.Tensor, num_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = self._check(qkv, num_heads)
        assert self.attention_lib is not None  # _check
        out = qkv.new_empty(B, T, num_heads * d)
        probs = torch.empty(B * num_heads, (T + 1) // 2, (T + 15) // 16 * 16, dtype=torch.int32)  # pairs of rows
        with torch.profiler.record_function("vitkit::attention"):
            rc = self.attention_lib.vk_attn_fwd(
                qkv.data_ptr(), out.data_ptr(), probs.data_ptr(), B, T, num_heads, d, scale, torch.get_num_threads()
            )
        _raise_for(rc)
        return out, probs

    def attention_backward(
        self, grad: torch.Tensor, qkv: torch.Tensor, probs: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        B, T, d = self._check(qkv, num_heads)
        assert self.attention_lib is not None  # _check
        grad = grad.to(torch.bfloat16).contiguous()
        want = (B * num_heads, (T + 1) // 2, (T + 15) // 16 * 16)
        if grad.shape != (B, T, num_heads * d):
            raise ValueError(f"attention backward: a gradient of shape {tuple(grad.shape)} for qkv {tuple(qkv.shape)}")
        if probs.dtype != torch.int32 or probs.shape != want or not probs.is_contiguous():
            raise ValueError("attention backward: the probabilities must be the attention kernel's own")
        dqkv = torch.empty_like(qkv)
        with torch.profiler.record_function("vitkit::attention_backward"):
            rc = self.attention_lib.vk_attn_bwd(
                qkv.data_ptr(), grad.data_ptr(), probs.data_ptr(), dqkv.data_ptr(),
                B, T, num_heads, d, scale, torch.get_num_threads(),
            )  # fmt: skip
        _raise_for(rc)
        return dqkv


def _raise_for(rc: int) -> None:
    if rc == -1:
        raise MemoryError("the attention kernel could not allocate its buffers")
    if rc != 0:
        raise ValueError("the attention kernel refused its arguments")


def load(
    gelu: bool = True, softmax: bool = True, attention: bool = True, linear: bool = True
) -> CpuTrainingKernels | None:
    """The kernels compiled for this CPU, or None where they cannot run (see the module docstring)."""
    lib = native.load(native.kernel_source(SOURCE), "vk_train", FLAGS, NEEDS)
    if lib is None:
        return None
    attention_lib = (
        native.load(native.kernel_source(ATTENTION_SOURCE), "vk_train_attention", FLAGS, NEEDS) if attention else None
    )
    return CpuTrainingKernels(lib, gelu, softmax, attention_lib, linear)
