"""fp8 inference on GPUs with fp8 tensor cores: ``--precision fp8``.

Every Linear of the transformer blocks (q/k/v, the attention's output projection and the two MLP layers: ~95% of
B/16's FLOPs at 224 px) becomes an fp8 GEMM (``torch._scaled_mm``: e4m3 operands, fp32 accumulation, bf16
output), with "rowwise" scales as torchao's float8 inference uses them:

- weights are quantised once, one scale per output channel: ``W ~ Wq * s_w`` with each row's max |w| at 448,
  e4m3's largest value;
- activations are quantised at each call, one scale per token (row of the (B*T, D) input), likewise;
- ``y = (Xq Wq^T) * s_x * s_w^T + b``, the product in fp32 inside the GEMM, the result in bf16.

The patch embedding, the LayerNorms, attention itself (SDPA in bf16), the pooling and the head stay in bf16.
fp8 tensor cores exist from NVIDIA compute capability 8.9 on (Ada, Hopper, Blackwell); elsewhere
:func:`fp8_unsupported` says why, and the engine refuses ``--precision fp8`` in one line.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
FP8_MIN_CAPABILITY = (8, 9)  # Ada; Hopper is (9, 0)


def fp8_unsupported(device: torch.device | str) -> str | None:
    """Why ``device`` cannot run fp8 GEMMs (None: it can): a CUDA GPU of compute capability 8.9 or later with a
    PyTorch that has ``torch._scaled_mm``."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8 needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper), not {device}"
    if not torch.cuda.is_available():
        return "fp8 needs a CUDA GPU, and CUDA is not available here"
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"fp8 needs fp8 tensor cores (compute capability 8.9+); {name} has {cap[0]}.{cap[1]}"
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no fp8 GEMM (torch._scaled_mm)"
    return None


GRANULARITIES = ("row", "tensor")


def quantize_rows(x: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (e4m3 (M, K), float32 scales (M, 1)) with ``x ~ q * scale``, each row's max |x| mapped to 448
    (an all-zero row keeps a tiny scale and quantises to zeros). ``granularity="tensor"``: one scale for the
    whole tensor, a 0-d tensor (cuBLAS's fp8 GEMM instead of CUTLASS's rowwise one)."""
    if granularity == "row":
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)  # (M, 1)
    else:
        amax = x.abs().amax().float().clamp(min=1e-12)  # ()
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # (M, K)
    return q, scale


def fp8_shape_ok(layer: nn.Linear) -> bool:
    """Whether ``_scaled_mm`` takes this layer: both of its dimensions multiples of 16."""
    return layer.in_features % 16 == 0 and layer.out_features % 16 == 0


class Fp8Linear(nn.Module):
    """A frozen ``nn.Linear`` as an fp8 GEMM: weights e4m3 with per-output-channel scales, activations quantised
    per row at each call, output bf16 (see the module docstring)."""

    weight_fp8: torch.Tensor  # (N, K) e4m3
    weight_scale: torch.Tensor  # (1, N) float32
    bias: torch.Tensor | None  # (N,) bf16

    def __init__(self, linear: nn.Linear, granularity: str = "row") -> None:
        super().__init__()
        if not fp8_shape_ok(linear):
            raise ValueError(f"fp8 GEMMs need dimensions that are multiples of 16, got {linear.weight.shape}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.granularity = granularity
        w_q, w_scale = quantize_rows(linear.weight.detach(), granularity)  # (N, K), (N, 1) or ()
        self.register_buffer("weight_fp8", w_q)
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # (1, N) or (): scale_b of _scaled_mm
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, s = quantize_rows(x.reshape(-1, self.in_features), self.granularity)  # (M, K), (M, 1) or ()
        # weight_fp8.t(): (K, N), column-major, as _scaled_mm wants its second operand
        out = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=s, scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, scales per {self.granularity}"


class CastModel(nn.Module):
    """``model`` run on images cast to ``dtype``, without gradients: ``forward``, ``forward_features``,
    ``forward_head`` and ``head`` as the model's (the interface of the fast path's ``InferenceViT``)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.to(self.dtype))  # (B, K)

    @torch.no_grad()
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x.to(self.dtype))  # type: ignore[operator]

    @torch.no_grad()
    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.model.forward_head(tokens, pre_logits=pre_logits)  # type: ignore[operator]

    @property
    def head(self) -> nn.Module:
        return self.model.head  # type: ignore[return-value]


def to_fp8(model: nn.Module, granularity: str = "row") -> CastModel:
    """A copy of ``model`` (left untouched) in bf16 with every Linear inside its transformer blocks
    (``model.blocks``) as an :class:`Fp8Linear` where its shape allows (multiples of 16; others stay bf16).
    Runs wherever ``torch._scaled_mm`` does; the engine allows it only where :func:`fp8_unsupported` is None.
    ``granularity``: "row" (default; see :class:`Fp8Linear`) or "tensor" (one scale per weight and per input).
    The copy runs as a :class:`CastModel` taking float images (cast to bf16)."""
    fp8 = copy.deepcopy(model).eval().to(torch.bfloat16)
    for block in fp8.blocks:  # type: ignore[union-attr]
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and fp8_shape_ok(child):
                    setattr(parent, name, Fp8Linear(child, granularity))
    return CastModel(fp8, torch.bfloat16)
