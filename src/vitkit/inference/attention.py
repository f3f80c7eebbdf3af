"""A fused bf16 attention kernel for the CPU inference fast path (AVX-512 BF16), written in C.

``softmax(scale q k^T) v`` for every (image, head), reading q, k and v straight from the fused qkv GEMM's
(B*T, 3D) output and writing the (B*T, D) token layout the out-projection reads: no contiguity copies,
no transposes, no (T, T) scores in memory. Per (image, head) the keys are packed once into bf16 pairs along
d and the values into pairs along T (the operand layouts of ``vdpbf16ps``); then for each block of 6 query
rows the scores are made in fp32 in registers and L1, their softmax numerators (a degree-4 polynomial exp)
rounded to bf16, multiplied by v with ``vdpbf16ps`` and scaled by 1/sum into the bf16 output. (image, head)
pairs are split over threads by OpenMP; the library links ``libgomp.so.1``, which is PyTorch's own OpenMP
runtime once torch is loaded (same soname), so the kernel shares torch's thread pool instead of adding one.

``load_int8`` gives the kernel's int8 variant (``attention_int8.c``, for the int8 fast path, on CPUs with
AVX512_VNNI too): the same structure with both products by ``vpdpbusd`` (u8 x s8 -> s32), k quantised to u8 per
channel with an offset, q (the key scales folded in) to s8 per row, v to s8 per channel, all per (image, head)
while packing, and the softmax numerators to u8 (255 at the row maximum); scheme and error in its source and
BENCHMARKS.md.

The source is compiled at first use by the system C compiler (:mod:`vitkit.native`, cached per content);
:func:`load` returns None where that is impossible (no compiler, no AVX512_BF16, not Linux), and the
fast path keeps its PyTorch attention there.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from vitkit import native

FLAGS = ("-fopenmp", "-fno-strict-aliasing", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
SOURCE = Path(__file__).with_name("attention.c")


AMX_FLAGS = (*FLAGS, "-mamx-tile", "-mamx-bf16")
AMX_NEEDS = (*NEEDS, "amx_tile", "amx_bf16")
AMX_SOURCE = Path(__file__).with_name("attention_amx.c")  # compiled after attention.c, whose packing it shares

INT8_FLAGS = (*FLAGS, "-mavx512dq", "-mavx512vnni")
INT8_NEEDS = (*NEEDS, "avx512dq", "avx512_vnni")
INT8_SOURCE = Path(__file__).with_name("attention_int8.c")


class FusedAttention:
    """The loaded kernel: ``attn(qkv, batch, heads, head_dim, scale)`` -> (B*T, D) bf16 output.
    ``symbol``: ``vk_attention_bf16`` (bf16 products), ``vk_attention_amx`` (the same on AMX tiles, :func:`load_amx`;
    head widths it does not take go to ``fallback``, the AVX-512 kernel of the same library) or ``vk_attention_int8``
    (:func:`load_int8`)."""

    def __init__(self, lib: ctypes.CDLL, symbol: str = "vk_attention_bf16") -> None:
        self.int8 = symbol == "vk_attention_int8"
        self.amx = symbol == "vk_attention_amx"
        self.fallback = FusedAttention(lib) if self.amx else None
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        fn.argtypes = [p, p, i, i, i, i, n, n, ctypes.c_float, i]
        self.fn = fn

    def supports(self, qkv: torch.Tensor, head_dim: int, batch: int = 1) -> bool:
        """Whether ``qkv`` (B*T, 3D) of ``batch`` images can go through the kernel: bf16 on CPU, rows contiguous,
        d even (bf16), and within the kernel's 32-bit integers (int8: below 2^31 / max(255, 4 ceil(d / 4))
        tokens: 8,421,504 up to d = 252; ViTConfig allows 2^20)."""
        T = qkv.shape[0] // batch if batch > 0 else 0
        return (
            qkv.device.type == "cpu"
            and qkv.dtype == torch.bfloat16
            and qkv.dim() == 2
            and qkv.stride(1) == 1
            and (self.int8 or (qkv.stride(0) % 2 == 0 and head_dim % 2 == 0))  # bf16: pairs of bf16 as dwords
            and qkv.shape[0] * qkv.stride(0) < 2**32  # the kernel's k gather indexes in 32 bits (T * stride / 2)
            # int8: packed keys gathered by 32-bit byte offsets (t * 4 ceil(d / 4)), softmax sums 255 T in int32;
            # the probabilities x values products are summed in int32 runs of 65,536 keys and in fp32 beyond
            and (not self.int8 or max(255, 4 * -(-head_dim // 4)) * T < 2**31)
        )

    @staticmethod
    def amx_takes(head_dim: int) -> bool:
        """Head widths of the AMX kernel: multiples of 32 (its tiles' 32 bf16 per row) up to 128."""
        return head_dim % 32 == 0 and head_dim <= 128

    def __call__(self, qkv: torch.Tensor, batch: int, heads: int, head_dim: int, scale: float = 1.0) -> torch.Tensor:
        """qkv: (B*T, 3 h d) bf16 with q, k, v side by side, head-major within each -> (B*T, h d) bf16."""
        if not self.supports(qkv, head_dim, batch):
            raise ValueError(
                "the fused attention kernel needs a bf16 CPU (B*T, 3D) tensor, an even head_dim (bf16) and at most "
                "2^31 bytes of packed keys per head (int8)"
            )
        BT, width = qkv.shape
        D = heads * head_dim
        if scale <= 0:  # the kernel takes the row maximum before scaling
            raise ValueError(f"the fused attention kernel needs a positive scale, got {scale}")
        if width != 3 * D or BT % batch:
            raise ValueError(f"qkv of shape {tuple(qkv.shape)} does not hold {batch} images of {heads} x {head_dim}")
        if self.fallback is not None and not self.amx_takes(head_dim):
            return self.fallback(qkv, batch, heads, head_dim, scale)
        out = qkv.new_empty(BT, D)
        T, threads = BT // batch, torch.get_num_threads()
        with torch.profiler.record_function("vitkit::fused_attention"):  # a named op in profiles
            rc = self.fn(qkv.data_ptr(), out.data_ptr(), batch, T, heads, head_dim, qkv.stride(0), D, scale, threads)
        if rc == -1:
            raise MemoryError("the fused attention kernel could not allocate its buffers")
        if rc != 0:
            raise ValueError(f"the fused attention kernel refused its arguments (T={T}, head_dim={head_dim})")
        return out


def load() -> FusedAttention | None:
    """The kernel compiled for this CPU, or None where it cannot run (see the module docstring)."""
    lib = native.load(SOURCE.read_text(), "vk_attention", FLAGS, NEEDS)
    return None if lib is None else FusedAttention(lib)


def load_int8() -> FusedAttention | None:
    """The int8 variant (``attention_int8.c``: both products by ``vpdpbusd``, q, k, v and the probabilities
    quantised per (image, head) inside the kernel; for the int8 fast path), or None where it cannot run
    (no compiler, no AVX512_BF16 or AVX512_VNNI, not Linux)."""
    lib = native.load(native.kernel_source(INT8_SOURCE), "vk_attention_int8", INT8_FLAGS, INT8_NEEDS)
    return None if lib is None else FusedAttention(lib, "vk_attention_int8")


def load_amx() -> FusedAttention | None:
    """The bf16 kernel on AMX tiles (``attention_amx.c``; head widths other than 32, 64, 96, 128 run the AVX-512
    kernel), or None where it cannot run (no compiler, no AMX-BF16, not Linux, or Linux refuses the process the
    tile state)."""
    source = f'{SOURCE.read_text()}\n#line 1 "{AMX_SOURCE.name}"\n{AMX_SOURCE.read_text()}'
    lib = native.load(source, "vk_attention_amx", AMX_FLAGS, AMX_NEEDS)
    if lib is None or lib.vk_amx_enable() != 0:
        return None
    return FusedAttention(lib, "vk_attention_amx")
