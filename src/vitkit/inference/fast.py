"""An inference-only fast path for a trained ViT: ``optimize_for_inference(model)``.

The transform keeps the model's function and changes how it is computed:

- weights cast once to the serving dtype (bf16 by default) and, on CPU, pre-packed into oneDNN's blocked
  layout for the batch size seen, so no GEMM reorders its weights per call;
- bias + GELU fused into the first MLP GEMM and bias + residual add fused into the attention output and
  second MLP GEMMs (oneDNN post-ops), tokens kept as one (B*T, D) matrix so no layout copy surrounds them;
- attention, chosen at run time: in bf16 on a CPU with AVX512_BF16 and a C compiler, vitkit's fused C
  kernel (``vitkit.inference.attention``: scores, softmax and probabilities x v per block of query rows
  in registers and L1, q/k/v read straight from the qkv GEMM's output and the result written in the token
  layout; B/16 b32 +6-8% bf16 / +11-12% int8 end to end, S/16 and Ti/16 +11-24%, BENCHMARKS.md; for int8
  its VNNI variant, ``load_int8``, with q, k, v and the probabilities in 8 bits); otherwise on
  CPU softmax(q k^T) v as two batched GEMMs over groups of images (and chunks of heads) small enough for
  their scores to stay in cache (faster than PyTorch's CPU flash kernel for ViT's sequence lengths); on
  CUDA PyTorch's fused ``scaled_dot_product_attention``; the 1/sqrt(d) scale is folded into the query
  weights;
- in bf16 on a CPU with AVX512_BF16 and a C compiler, LayerNorm by a C kernel (``vitkit.inference.layernorm``:
  the same fp32 arithmetic as PyTorch's, 2.1-2.4x faster on the (B*T, D) tokens; Ti/16 +3%, S/16 +2%);
- on CPU the MLP runs over chunks of rows whose hidden activation stays ~10 MiB, ~5 MiB in bf16 (in L3, and below
  glibc's mmap threshold: no page faults per call);
- optionally int8 linear layers (``vitkit.inference.int8``: per-channel int8 weights, activations quantised
  per call by a C kernel where the CPU has AVX-512: dynamic quantisation; the GEMMs by a VNNI kernel in C,
  ``vitkit.inference.gemm_int8``, where the CPU has AVX512_VNNI/BF16, else by oneDNN's;
  7-bit on CPUs without VNNI, see ``quantize_dynamic_u7``; with the C quantiser, norm1 -> qkv and norm2 -> fc1
  run LayerNorm and quantisation as one kernel, ``LayerNormQuantize``), or
  ``torch.compile`` of the whole forward instead of hand packing.

The patch embedding, class token, position embedding (with on-the-fly resampling for other resolutions),
final norm and head are the original model's own modules, cast to the dtype, except that on CPU at the model's
own image size the patch embedding runs as one pre-packed GEMM (``vitkit.inference.stem``: Ti/16 +2%) and in
bf16 the final norm is the C LayerNorm. The result is an
``nn.Module`` for inference only (no gradients, no state dict).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from vitkit import hardware
from vitkit.inference.attention import FusedAttention
from vitkit.inference.attention import load as load_fused_attention
from vitkit.inference.attention import load_amx as load_amx_attention
from vitkit.inference.attention import load_int8 as load_int8_attention
from vitkit.inference.backends import optimize_with_backend
from vitkit.inference.gemm_int8 import Int8Gemm
from vitkit.inference.gemm_int8 import load as load_int8_gemm
from vitkit.inference.int8 import (
    Int8Linear,
    LayerNormQuantize,
    NativeQuantizer,
    Quantizer,
    fast_quantizer,
    has_onednn_int8,
)
from vitkit.inference.layernorm import NativeLayerNorm
from vitkit.inference.layernorm import load as load_layernorm
from vitkit.inference.stem import PackedStem
from vitkit.models.layers import LayerScale
from vitkit.models.rope import apply_rope
from vitkit.models.vit import Attention, Block, Rope, VisionTransformer

SCORES_CHUNK_BYTES = 6 << 20  # attention scores per chunk of heads, explicit path (measured on a 32 MiB L3)
# The MLP's hidden activation per chunk of rows (CPU). Whole, B/16 at batch 32 makes it 37 MiB, above glibc's
# largest mmap threshold (32 MiB): every call then maps fresh pages and faults them in (220k page faults,
# 0.36 s of kernel time per call, measured), and it leaves L3 between fc1 and fc2. Chunks of ~10 MiB: +5%.
MLP_CHUNK_BYTES = 10 << 20
# bf16 (not int8, whose activation scales are per chunk): chunks of ~5 MiB, measured faster still, alternating in
# one process (benchmarks/int8_ab.py --precision bf16 --variant mlp_bytes=10 mlp_bytes=5): Ti/16 b32 +11%,
# S/16 +3.3%, B/16 +1.4% (BENCHMARKS.md, 2026-11-24); 3 MiB was slower on B/16
BF16_MLP_CHUNK_BYTES = 5 << 20


def chunk_rows(rows: int, row_bytes: int, budget: int) -> int:
    """Rows per chunk when ``rows`` rows of ``row_bytes`` each are split into equal chunks of at most
    ``budget`` bytes (at least one row)."""
    chunks = max(1, -(-rows * row_bytes // budget))
    return max(1, -(-rows // chunks))


@dataclass(frozen=True)
class Kernels:
    """Which implementation each replaceable piece of the CPU fast path uses; ``None`` keeps the built-in rule
    (the fastest on the Zen 4 and Xeons the defaults were measured on). ``vitkit.inference.tune`` chooses these by
    timing them on the model's own shapes.

    - ``attention``: ``"amx"`` (the fused C kernel on AMX tiles, bf16, for int8 too: AMX-BF16 CPUs), ``"c"``
      (vitkit's fused C kernel, bf16/int8 on AVX512_BF16 CPUs), ``"explicit"`` (two
      batched GEMMs over cache-sized chunks of heads) or ``"sdpa"`` (PyTorch's ``scaled_dot_product_attention``:
      its CPU flash kernel);
    - ``layernorm``: ``"c"`` (vitkit's C LayerNorm, bf16) or ``"torch"``;
    - ``gemm``: ``"packed"`` (oneDNN weights pre-packed, epilogues as post-ops) or ``"plain"`` (``F.linear``,
      the oneDNN/AMX kernel PyTorch itself picks); with int8, ``"vnni"`` (vitkit's C GEMM) or ``"onednn"``.
    """

    attention: str | None = None
    layernorm: str | None = None
    gemm: str | None = None

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ("amx", "c", "explicit", "sdpa"),
        "layernorm": ("c", "torch"),
        "gemm": ("packed", "plain", "vnni", "onednn"),
    }

    def __post_init__(self) -> None:
        for piece, options in self.CHOICES.items():
            value = getattr(self, piece)
            if value is not None and value not in options:
                raise ValueError(f"Kernels.{piece}: {value!r} is not one of {', '.join(options)}")


class PackedLinear(nn.Module):
    """A Linear in ``dtype`` with an optional fused epilogue: ``"none"``, ``"gelu"``/``"gelu_tanh"``, or
    ``"add"`` (``forward(x, other)`` returns ``linear(x) + other``).

    On CPU with oneDNN the weight is reordered once into oneDNN's blocked layout and the epilogue runs as a
    GEMM post-op; elsewhere (CUDA, no oneDNN) it is a plain ``F.linear`` followed by the epilogue.
    """

    def __init__(
        self, linear: nn.Linear, dtype: torch.dtype, epilogue: str = "none", rows: int | None = None, pack: bool = True
    ) -> None:
        super().__init__()
        if epilogue not in ("none", "gelu", "gelu_tanh", "add"):
            raise ValueError(f"unknown epilogue {epilogue!r}")
        self.epilogue = epilogue
        weight = linear.weight.detach().to(dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        self.packed = pack and weight.device.type == "cpu" and hardware.has_onednn_linear(dtype)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self.weight: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            if self.epilogue == "add":
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")
            if self.epilogue == "none":
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            algo = "tanh" if self.epilogue == "gelu_tanh" else "none"
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], algo)
        y = F.linear(x, self.weight, self.bias)
        if self.epilogue == "add":
            assert other is not None
            return y + other
        if self.epilogue == "none":
            return y
        return F.gelu(y, approximate="tanh" if self.epilogue == "gelu_tanh" else "none")


class FastBlock(nn.Module):
    """One pre-LN block (paper eqs. 2-3) on tokens flattened to (B*T, D), fused as described above."""

    def __init__(
        self,
        block: Block,
        dtype: torch.dtype,
        rows: int | None,
        quantize: Quantizer | None = None,
        pack: bool = True,
        fused: FusedAttention | None = None,
        gemm: Int8Gemm | None = None,
        layernorm: Any = None,
        explicit: bool | None = None,
        pack_gemm: bool | None = None,
    ) -> None:
        super().__init__()
        self.fused = fused  # the C attention kernel (bf16, AVX512_BF16 CPUs; int8 variant for int8), else None
        self.num_heads = block.attn.num_heads
        self.head_dim = block.attn.head_dim
        # bf16: the C LayerNorm (``vitkit.inference.layernorm``) where it loads, else PyTorch's; also for EVA-02's LN
        # of the MLP's hidden (after the act) and EVA-CLIP's of the merged heads (before proj), where they are
        native = lambda norm: NativeLayerNorm(copy.deepcopy(norm).to(dtype), layernorm)  # noqa: E731
        self.norm1, self.norm2 = native(block.norm1), native(block.norm2)
        # the MLP's activation: GELU (exact or tanh) fused into fc1's GEMM; QuickGELU and SwiGLU after a plain one
        mlp = block.mlp
        fusable = mlp.kind == "plain" and mlp.gelu in ("exact", "tanh")
        gelu = ("gelu_tanh" if mlp.gelu == "tanh" else "gelu") if fusable else "none"
        self.act = None if fusable else mlp.act
        sub_ln = mlp.norm if isinstance(mlp.norm, nn.LayerNorm) else None
        self.mlp_norm, self.attn_norm = (None if n is None else native(n) for n in (sub_ln, block.attn.norm))
        qkv = _scaled_qkv(block.attn, block.attn.scale)  # 1/sqrt(d) folded into the query rows
        # layer scale (DINOv2/v3) folded into the branch's last Linear: x + g * (W o + b) = x + (g W) o + g b
        proj, fc2 = _scaled_rows(block.attn.proj, block.ls1), _scaled_rows(mlp.fc2, block.ls2)
        # CPU: softmax(q k^T) v as batched GEMMs over chunks of heads whose (T, T) scores fit in cache
        # (~6 MiB) beats the fused flash kernel at ViT's sequence lengths (BENCHMARKS.md); CUDA: SDPA.
        # ``explicit``/``pack_gemm``: a measured choice (``Kernels``) overriding that rule
        cpu_layout = pack and block.attn.qkv.weight.device.type == "cpu"
        self.explicit_attention = cpu_layout if explicit is None else explicit and cpu_layout
        pack = pack if pack_gemm is None else pack and pack_gemm
        self.scores_bytes = SCORES_CHUNK_BYTES
        # CPU: the MLP runs over chunks of rows (MLP_CHUNK_BYTES, BF16_MLP_CHUNK_BYTES in bf16); its weights are
        # packed for that many rows
        hidden = self.fc1_features = block.mlp.fc1.out_features  # SwiGLU: gate and up, 2 x mlp_dim
        budget = BF16_MLP_CHUNK_BYTES if dtype == torch.bfloat16 and quantize is None else MLP_CHUNK_BYTES
        self.mlp_bytes = budget if cpu_layout else 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        mlp_rows = rows if rows is None or not self.mlp_bytes else chunk_rows(rows, hidden * itemsize, self.mlp_bytes)
        self.fuse_norm = False  # int8 with the C quantiser: LayerNormQuantize for norm1 -> qkv, norm2 -> fc1
        self.rows_quantize: Quantizer | None = None  # int8: proj's and fc2's quantiser (NativeQuantizer.per_row)
        if quantize is not None:
            self.qkv: nn.Module = Int8Linear(qkv, dtype, "none", rows, quantize, gemm)
            self.proj: nn.Module = Int8Linear(proj, dtype, "add", rows, quantize, gemm)
            self.fc1: nn.Module = Int8Linear(mlp.fc1, dtype, gelu, mlp_rows, quantize, gemm)
            self.fc2: nn.Module = Int8Linear(fc2, dtype, "add", mlp_rows, quantize, gemm)
            # LayerNorm -> quantiser as one C kernel where the quantiser is the C one (bf16 rows)
            kernel = quantize if isinstance(quantize, NativeQuantizer) else None
            self.fuse_norm = kernel is not None
            # the inputs of proj and fc2 (attention output, fc1's output) quantised per row, one pass from memory per
            # row, where the VNNI GEMM takes per-row scales
            # (Int8Linear takes the kernel for bf16 outputs and K <= 65536: an fc2 wider than that runs oneDNN's
            # GEMM, which takes one scale per tensor; see mlp())
            vnni = self.proj.gemm is not None
            self.rows_quantize = kernel.per_row if kernel is not None and vnni else None
            self.norm1_q = LayerNormQuantize(self.norm1.norm, quantize, kernel)
            self.norm2_q = LayerNormQuantize(self.norm2.norm, quantize, kernel)
        else:
            self.qkv = PackedLinear(qkv, dtype, "none", rows, pack)
            self.proj = PackedLinear(proj, dtype, "add", rows, pack)
            self.fc1 = PackedLinear(mlp.fc1, dtype, gelu, mlp_rows, pack)
            self.fc2 = PackedLinear(fc2, dtype, "add", mlp_rows, pack)

    def forward(self, x: torch.Tensor, batch: int, rope: Rope | None = None) -> torch.Tensor:
        # x: (B*T, D); rope: the RoPE tables (N, d) of the patch grid in the serving dtype, for RoPE models
        BT, D = x.shape
        T, h, d = BT // batch, self.num_heads, self.head_dim
        if self.fuse_norm:  # int8: LN1's output quantised as it is computed
            qkv = cast(Int8Linear, self.qkv).forward_quantized(*self.norm1_q(x))  # (B*T, 3D)
        else:
            qkv = self.qkv(self.norm1(x))  # (B*T, 3D)
        if rope is not None:  # q and k of the patch rows rotated in place, before any attention kernel reads them
            qk = qkv.view(batch, T, 3, h, d)[:, T - rope[0].shape[0] :, :2]  # (B, N, 2, h, d) view
            qk.copy_(apply_rope(qk, rope[0][:, None, None], rope[1][:, None, None]))
        if self.fused is not None and self.fused.supports(qkv, d, batch):
            o = self.fused(qkv, batch, h, d)  # (B*T, D), read from and written in the token layout
        else:
            heads = qkv.view(batch, T, 3, h, d).permute(2, 0, 3, 1, 4)  # (3, B, h, T, d)
            if self.explicit_attention:
                o = self.explicit(heads, batch, T)
            else:
                q, k, v = heads.unbind(0)  # 3 x (B, h, T, d), strided views
                o = F.scaled_dot_product_attention(q, k, v, scale=1.0)  # (B, h, T, d)
            o = o.transpose(1, 2).reshape(BT, D)  # (B*T, D)
        o = o if self.attn_norm is None else self.attn_norm(o)
        if self.rows_quantize is not None:  # int8: the attention output quantised per row
            x = cast(Int8Linear, self.proj).forward_quantized(*self.rows_quantize(o), x)  # x + proj(o)
        else:
            x = self.proj(o, x)  # x + proj(o)
        step = chunk_rows(BT, self.fc1_features * x.element_size(), self.mlp_bytes) if self.mlp_bytes else BT
        if step >= BT:
            return self.mlp(x)
        out = torch.empty_like(x)
        for i in range(0, BT, step):
            out[i : i + step] = self.mlp(x[i : i + step])
        return out

    def explicit(self, qkv: torch.Tensor, batch: int, T: int) -> torch.Tensor:
        """softmax(q k^T) v as two batched GEMMs (the scale is in q already) over groups of images, and within
        a group over chunks of heads, whose (T, T) scores stay in cache (``scores_bytes``). q, k and v are
        made contiguous one group at a time: the copy of the whole (3, B, h, T, d) at once ran at a quarter of
        the speed of the same copy per group, in cache (B/16 b32: 7 ms of 130 per layer, measured).
        qkv: (3, B, h, T, d) view -> (B, h, T, d)."""
        h, d = self.num_heads, self.head_dim
        o = qkv.new_empty(batch, h, T, d)
        image_bytes = h * T * T * qkv.element_size()
        images = chunk_rows(batch, image_bytes, self.scores_bytes)  # images per group
        heads = max(1, self.scores_bytes // (T * T * qkv.element_size()))  # (image, head) pairs per chunk
        for b in range(0, batch, images):
            q, k, v = qkv[:, b : b + images].contiguous().view(3, -1, T, d).unbind(0)  # 3 x (n*h, T, d)
            out = o[b : b + images].view(-1, T, d)
            for i in range(0, q.shape[0], heads):
                probs = torch.bmm(q[i : i + heads], k[i : i + heads].transpose(1, 2)).softmax(dim=-1)  # (n, T, T)
                torch.bmm(probs, v[i : i + heads], out=out[i : i + heads])
        return o

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_norm:
            h = cast(Int8Linear, self.fc1).forward_quantized(*self.norm2_q(x))  # (rows, hidden)
        else:
            h = self.fc1(self.norm2(x))  # (rows, hidden): GELU fused, or fc1's plain output
        h = h if self.act is None else self.act(h)  # QuickGELU, SwiGLU: the model's own, in the serving dtype
        h = h if self.mlp_norm is None else self.mlp_norm(h)
        if self.fuse_norm and self.rows_quantize is not None and cast(Int8Linear, self.fc2).gemm is not None:
            return cast(Int8Linear, self.fc2).forward_quantized(*self.rows_quantize(h), x)
        return self.fc2(h, x)  # x + fc2(act(fc1(LN(x))))


def _scaled_qkv(attn: Attention, scale: float) -> nn.Linear:
    """A copy of the attention's fused q/k/v Linear, with its whole bias ([q; 0; v] without a key bias), whose
    query rows (weight and bias) are multiplied by ``scale``."""
    rows = torch.ones(attn.qkv.out_features, dtype=attn.qkv.weight.dtype, device=attn.qkv.weight.device)
    rows[: attn.qkv.out_features // 3] = scale
    return _rows_times(attn.qkv.weight, attn.qkv_bias(), rows)


def _scaled_rows(linear: nn.Linear, scale: nn.Module) -> nn.Linear:
    """``linear``, or where ``scale`` is a :class:`LayerScale` a copy with its output rows (weight and bias)
    multiplied by the scales."""
    return _rows_times(linear.weight, linear.bias, scale.gamma) if isinstance(scale, LayerScale) else linear


def _rows_times(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> nn.Linear:
    """A new Linear whose output row i is row i of ``weight`` (and ``bias``) times ``rows[i]``."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).to(weight)
    with torch.no_grad():
        out.weight.copy_(weight * rows[:, None])
        if bias is not None:
            out.bias.copy_(bias * rows)
    return out


def block_parts(kernels: Kernels, dtype: torch.dtype, int8: bool, cpu: bool, pack: bool) -> dict[str, Any]:
    """The keyword arguments of :class:`FastBlock` that ``kernels`` chooses on a CPU (``cpu``) whose weights are
    packed by hand (``pack``; else compiled), the C kernels loaded where they run: the quantiser, the fused
    attention (bf16; for int8 its VNNI variant where the CPU has VNNI), the int8 GEMM, the C LayerNorm, and the
    overrides of the explicit attention and of packing."""
    bf16 = cpu and dtype == torch.bfloat16
    fused = None
    # bf16: AMX tiles first where the CPU has them (3.5x the AVX-512 kernel at T=261, d=64); int8: its VNNI kernel
    # first (as fast as AMX's bf16 one end to end, measured), AMX's when chosen
    if pack and bf16 and (kernels.attention == "amx" or (kernels.attention is None and not int8)):
        fused = load_amx_attention()
    if pack and bf16 and fused is None and kernels.attention in (None, "amx", "c"):
        fused = (load_int8_attention() if int8 else None) or load_fused_attention()
    return {
        "quantize": fast_quantizer() if int8 else None,
        "fused": fused,
        # int8 GEMMs: vitkit's VNNI kernel, except where oneDNN's run on AMX's int8 tiles (measured 1.5x faster on
        # DINOv2-S/14 b32, Xeon family 6 model 167; BENCHMARKS.md "Model families")
        "gemm": load_int8_gemm() if int8 and bf16 and _vnni_gemm(kernels) else None,
        "layernorm": load_layernorm() if pack and bf16 and not int8 and kernels.layernorm != "torch" else None,
        "explicit": None if kernels.attention in (None, "amx", "c") else kernels.attention == "explicit",
        "pack_gemm": None if kernels.gemm is None else kernels.gemm != "plain",
    }


def _vnni_gemm(kernels: Kernels) -> bool:
    """Whether the int8 GEMMs are vitkit's VNNI kernel: chosen, or by the built-in rule (not on AMX CPUs)."""
    return kernels.gemm == "vnni" or (kernels.gemm is None and not hardware.has_amx_int8())


class InferenceViT(nn.Module):
    """What ``optimize_for_inference`` returns: ``forward(images) -> logits`` in the serving dtype;
    ``forward_features`` (final tokens) and ``forward_head(tokens, pre_logits=True)`` (pre-logits features)
    as on the model."""

    def __init__(
        self,
        model: VisionTransformer,
        dtype: torch.dtype,
        rows: int | None,
        int8: bool = False,
        pack: bool = True,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.dtype = dtype
        self.kernels = kernels or Kernels()
        cpu = next(model.parameters()).device.type == "cpu"
        parts = block_parts(self.kernels, dtype, int8, cpu, pack)
        base = copy.deepcopy(model).eval()
        # CPU: the patch embedding as one pre-packed GEMM (``vitkit.inference.stem``; constants from ``base``)
        self.stem = PackedStem(base, dtype, rows, PackedLinear) if pack and cpu and PackedStem.handles(base) else None
        self.use_stem = self.stem is not None
        blocks = [cast(Block, b) for b in base.blocks]
        base.blocks = nn.ModuleList()  # the stem, pos-emb, norm and head stay; blocks are replaced
        self.base = base.to(dtype)
        self.blocks = nn.ModuleList(FastBlock(b, dtype, rows, pack=pack, **parts) for b in blocks)
        self.norm = NativeLayerNorm(self.base.norm, parts["layernorm"])  # the final norm
        # CLIP's pre-norm after the packed stem (the model's ``embed`` applies it on the other route)
        pre = self.base.norm_pre
        self.norm_pre = NativeLayerNorm(pre, parts["layernorm"]) if isinstance(pre, nn.LayerNorm) else None
        self._rope: dict[tuple[int, int], Rope] = {}  # RoPE tables per patch grid, in the serving dtype

    @torch.no_grad()
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> final normed tokens (B, T, D), in the serving dtype."""
        if x.shape[0] == 0:  # an empty batch: the model's empty (0, T, D), from its own embedding (shape checks)
            return self.base.embed(x.to(self.dtype))
        z = self.forward_blocks(x)  # (B, T, D)
        B, T, D = z.shape  # fc_norm: the final norm is the head's, on the pooled vector
        return z if self.cfg.fc_norm else self.norm(z.reshape(B * T, D)).view(B, T, D)

    @torch.no_grad()
    def forward_blocks(self, x: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> the tokens (B, T, D) block ``depth`` (1..L, default L) outputs, before the final
        norm (the model's ``forward_intermediates(x).hidden_states[depth]``), in the serving dtype."""
        depth = len(self.blocks) if depth is None else depth
        if not 1 <= depth <= len(self.blocks):
            raise ValueError(f"depth must be in 1..{len(self.blocks)}, got {depth}")
        if self.stem is not None and self.use_stem and self.stem.supports(x):
            B = x.shape[0]
            z = self.stem(x)  # (B*T, D)
            if self.norm_pre is not None:
                z = self.norm_pre(z)
        else:
            z = self.base.embed(x.to(self.dtype))  # (B, T, D)
            B = z.shape[0]
            z = z.reshape(-1, z.shape[-1])
        T, D = z.shape[0] // B, z.shape[1]
        rope = self.rope(self.base.grid_of(x), x.device)
        for blk in self.blocks[:depth]:
            z = blk(z, B, rope)
        return z.view(B, T, D)

    def rope(self, grid: tuple[int, int], device: torch.device) -> Rope | None:
        """The model's RoPE tables for ``grid`` in the serving dtype (computed once per grid), or None."""
        if self.cfg.rope is None:
            return None
        if grid not in self._rope:
            cos, sin = self.base.rope(grid, device)  # type: ignore[misc]
            self._rope[grid] = (cos.to(self.dtype), sin.to(self.dtype))
        return self._rope[grid]

    @torch.no_grad()
    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Final tokens (B, T, D) -> logits (B, K), or with ``pre_logits=True`` the pre-logits features (B, R)
        that linear probes, few-shot evaluation and embeddings use (the model's pooling and optional
        pre-logits layer), in the serving dtype: ``forward_head(forward_features(x), pre_logits=True)`` is the
        model's own ``forward_head(forward_features(x), pre_logits=True)`` up to the dtype's rounding."""
        return self.base.forward_head(tokens, pre_logits)

    @property
    def head(self) -> nn.Module:
        """The classification head (features -> logits), in the serving dtype."""
        return self.base.head

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.forward_head(self.forward_features(x))


def optimize_for_inference(
    model: VisionTransformer,
    dtype: torch.dtype = torch.bfloat16,
    *,
    compile: bool = False,
    int8: bool = False,
    batch_size: int | None = None,
    backend: str = "torch",
    calibration: torch.Tensor | None = None,
    compile_mode: str | None = None,
    kernels: Kernels | None = None,
) -> nn.Module:
    """A copy of ``model`` for fast inference that computes the same function (up to ``dtype`` rounding).

    ``dtype``: torch.bfloat16 (default) or torch.float32. ``batch_size``: the batch you will serve, used to
    choose oneDNN's weight layout (any batch works). ``int8``: dynamically quantised linear layers (CPU
    only). ``compile``: instead of pre-packing the weights by hand, hand the fused forward to
    ``torch.compile`` (inductor with weight freezing, which packs and fuses itself; the first call
    compiles). On CPU the eager pre-packed path is the faster one (see BENCHMARKS.md); ``compile`` is the
    choice on CUDA. The original model is left untouched. The result has ``forward`` (logits),
    ``forward_features`` and ``forward_head(tokens, pre_logits=True)`` (pre-logits features); it runs without
    gradients.

    ``backend``: "torch" (the above), "onnxruntime" or "openvino" (exported to ONNX and run by that engine,
    ``calibration`` images for OpenVINO's int8; see ``vitkit.inference.backends``: callable like the model,
    no ``forward_features``), or "auto": whichever of these is fastest here in a short measurement.
    ``compile_mode``: torch.compile's ``mode`` with ``compile`` ("reduce-overhead": CUDA graphs). ``kernels``:
    which implementation each piece uses (:class:`Kernels`; default: the built-in rules;
    ``vitkit.inference.tune.tune_kernels`` measures them). To let vitkit
    choose all of this for the model's device, see ``vitkit.inference.policy.plan_engine``.
    """
    if backend != "torch":
        ours = functools.partial(
            optimize_for_inference, model, dtype, compile=compile, int8=int8, batch_size=batch_size
        )
        return optimize_with_backend(model, dtype, backend, int8, batch_size, calibration, ours)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    device = next(model.parameters()).device
    if int8 and (device.type != "cpu" or compile or not has_onednn_int8()):
        raise ValueError("int8 inference needs a CPU with oneDNN, and is not combined with compile")
    rows = None if batch_size is None else batch_size * model.cfg.num_tokens()
    with torch.inference_mode(False):  # normal tensors even when called in inference mode (compile freezes them)
        fast = InferenceViT(model, dtype, rows, int8, pack=not compile, kernels=kernels).eval()
    if compile:
        options: dict[str, Any] = {"freezing": True} if device.type == "cpu" else {}
        if compile_mode is not None:  # torch.compile takes a mode or options, not both
            return torch.compile(fast, dynamic=False, mode=compile_mode)  # type: ignore[return-value]
        return torch.compile(fast, dynamic=False, options=options or None)  # type: ignore[return-value]
    return fast
