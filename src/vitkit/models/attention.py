"""softmax(q k^T / sqrt(d)) v with a hand-written backward pass, for training on CPU.

PyTorch's fused ``scaled_dot_product_attention`` backward is slow on CPU at ViT's sequence lengths, and
autograd through the explicit formula spends a good part of the attention's time moving memory: it scales a
copy of q, copies k and v to contiguous heads, keeps its own copies for the backward pass, and there stacks
dq, dk and dv into a new tensor before permuting that into the qkv Linear's layout (BENCHMARKS.md, training
step profile). :func:`softmax_attention` computes the same function from the fused qkv projection:

- q, k and v are laid out as heads once (one copy of the projection, kept for the backward pass);
- the scale 1/sqrt(d) is the GEMM's alpha in the forward and both backward products, never a tensor pass;
- the probabilities are computed and kept once, in the activation dtype (bf16 under autocast);
- dq, dk and dv are written by their GEMMs straight into one (3, B*h, T, d) buffer, which becomes the qkv
  projection's gradient (B, T, 3D) with a single permuting copy.

Backward: with P = softmax(S), S = a q k^T, O = P v and dO given,
    dv = P^T dO,  dP = dO v^T,  dS = P * (dP - rowsum(dP * P)),  dq = a dS k,  dk = a dS^T q.
Autocast is off inside: every product runs in the dtype of the projection it is given (bf16 under bf16
autocast, as autocast would choose; float64 in the gradient check). With ``kernels``
(:class:`vitkit.models.fused.TrainingKernels`, e.g. vitkit's C kernels on CPU) the whole attention, forward
and backward, runs through them where they take the projection (``kernels.attention_supported``: the
function then keeps the projection and the kernels' own probabilities for the backward pass);
else the softmax runs in place through them where they take the logits; else PyTorch's.
:func:`attention_reference` / :func:`attention_backward_reference` are the same two passes in PyTorch, from
and to the projection's layout: what ``vitkit.models.fused.TorchKernels`` offers as its attention.
"""

from __future__ import annotations

from typing import Any

import torch

from vitkit.models.kernel_api import TrainingKernels


def _heads(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, 3D) -> (3, B*h, T, d), contiguous: q, k and v of every head as GEMM batches (one copy)."""
    B, T, three_d = qkv.shape
    d = three_d // (3 * num_heads)
    return qkv.reshape(B, T, 3, num_heads, d).permute(2, 0, 3, 1, 4).reshape(3, B * num_heads, T, d)


def _forward_heads(
    heads: torch.Tensor, scale: float, kernels: TrainingKernels | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B h, T, d), probabilities (B h, T, T)) from heads (3, B h, T, d)."""
    q, k, v = heads.unbind(0)
    BH, T, _ = q.shape
    probs = q.new_empty(BH, T, T).baddbmm_(q, k.transpose(1, 2), beta=0.0, alpha=scale)  # logits
    if kernels is not None and kernels.softmax_supported(probs):
        probs = kernels.softmax_(probs)  # (B h, T, T)
    else:
        probs = torch.softmax(probs, dim=-1)
    return torch.bmm(probs, v), probs  # (B h, T, d)


def _backward_heads(heads: torch.Tensor, probs: torch.Tensor, g: torch.Tensor, scale: float) -> torch.Tensor:
    """(3, B h, T, d): dq, dk, dv from heads, probabilities and dO (B h, T, d)."""
    q, k, v = heads.unbind(0)
    grad = torch.empty_like(heads)  # (3, B h, T, d): dq, dk, dv
    dq, dk, dv = grad.unbind(0)
    torch.bmm(probs.transpose(1, 2), g, out=dv)
    dp = torch.bmm(g, v.transpose(1, 2))  # (B h, T, T)
    ds = torch._softmax_backward_data(dp, probs, -1, probs.dtype)
    dq.baddbmm_(ds, k, beta=0.0, alpha=scale)
    dk.baddbmm_(ds.transpose(1, 2), q, beta=0.0, alpha=scale)
    return grad


def _merge(out: torch.Tensor, B: int) -> torch.Tensor:
    """(B h, T, d) -> (B, T, h d)."""
    BH, T, d = out.shape
    return out.reshape(B, BH // B, T, d).transpose(1, 2).reshape(B, T, BH // B * d)


def _split(grad_out: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, h d) -> (B h, T, d) in ``dtype``."""
    B, T, D = grad_out.shape
    d = D // num_heads
    return grad_out.to(dtype).reshape(B, T, num_heads, d).transpose(1, 2).reshape(B * num_heads, T, d)


def _to_projection(grad: torch.Tensor, B: int) -> torch.Tensor:
    """(3, B h, T, d) -> (B, T, 3 h d), the qkv projection's layout."""
    _, BH, T, d = grad.shape
    return grad.reshape(3, B, BH // B, T, d).permute(1, 3, 0, 2, 4).reshape(B, T, 3 * BH // B * d)


def attention_reference(qkv: torch.Tensor, num_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass in PyTorch: (out (B, T, D), probabilities (B h, T, T)) from ``qkv`` (B, T, 3D)."""
    out, probs = _forward_heads(_heads(qkv, num_heads), scale, None)
    return _merge(out, qkv.shape[0]), probs


def attention_backward_reference(
    grad_out: torch.Tensor, qkv: torch.Tensor, probs: torch.Tensor, num_heads: int, scale: float
) -> torch.Tensor:
    """The backward pass in PyTorch: the gradient of ``qkv`` (B, T, 3D) given that of the output (B, T, D)
    and the probabilities of :func:`attention_reference`."""
    heads = _heads(qkv, num_heads)
    grad = _backward_heads(heads, probs, _split(grad_out, num_heads, heads.dtype), scale)
    return _to_projection(grad, qkv.shape[0])


class _SoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, num_heads: int, scale: float, kernels: TrainingKernels | None
    ) -> torch.Tensor:
        ctx.scale, ctx.num_heads, ctx.kernels = scale, num_heads, kernels
        with torch.autocast(qkv.device.type, enabled=False):
            ctx.whole = kernels is not None and kernels.attention_supported(qkv, num_heads)
            if ctx.whole:
                assert kernels is not None
                out, probs = kernels.attention(qkv, num_heads, scale)  # (B, T, D), the kernels' own layout
                ctx.save_for_backward(qkv, probs)
                return out
            heads = _heads(qkv, num_heads)  # (3, B h, T, d)
            out, probs = _forward_heads(heads, scale, kernels)  # (B h, T, d), (B h, T, T)
        ctx.save_for_backward(heads, probs)
        return _merge(out, qkv.shape[0])  # (B, T, D)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward's GEMMs write into buffers (out=)
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.whole:
                qkv, probs = ctx.saved_tensors
                grad = ctx.kernels.attention_backward(grad_out, qkv, probs, ctx.num_heads, ctx.scale)
                return grad, None, None, None
            heads, probs = ctx.saved_tensors
            g = _split(grad_out, ctx.num_heads, heads.dtype)  # dO (B h, T, d)
            grad = _backward_heads(heads, probs, g, ctx.scale)
        return _to_projection(grad, grad_out.shape[0]), None, None, None  # (B, T, 3D)


def softmax_attention(
    qkv: torch.Tensor, num_heads: int, scale: float, kernels: TrainingKernels | None = None
) -> torch.Tensor:
    """Multi-head attention from the fused projection ``qkv`` (B, T, 3D), laid out as (3, h, d) on the last
    axis (q, k, v, each head after head): softmax(scale q k^T) v of every head, merged to (B, T, D)."""
    out: torch.Tensor = _SoftmaxAttention.apply(qkv, num_heads, scale, kernels)
    return out
