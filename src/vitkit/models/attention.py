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
(:class:`vitkit.models.fused.TrainingKernels`, e.g. vitkit's C kernels on CPU) the softmax runs in
place through them where they take the logits; else PyTorch's.
"""

from __future__ import annotations

from typing import Any

import torch

from vitkit.models.fused import TrainingKernels


def _heads(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, 3D) -> (3, B*h, T, d), contiguous: q, k and v of every head as GEMM batches (one copy)."""
    B, T, three_d = qkv.shape
    d = three_d // (3 * num_heads)
    return qkv.reshape(B, T, 3, num_heads, d).permute(2, 0, 3, 1, 4).reshape(3, B * num_heads, T, d)


class _SoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, num_heads: int, scale: float, kernels: TrainingKernels | None
    ) -> torch.Tensor:
        B, T, three_d = qkv.shape
        D = three_d // 3
        with torch.autocast(qkv.device.type, enabled=False):
            heads = _heads(qkv, num_heads)  # (3, B h, T, d)
            q, k, v = heads.unbind(0)
            BH = q.shape[0]
            probs = q.new_empty(BH, T, T).baddbmm_(q, k.transpose(1, 2), beta=0.0, alpha=scale)  # logits
            if kernels is not None and kernels.softmax_supported(probs):
                probs = kernels.softmax_(probs)  # (B h, T, T)
            else:
                probs = torch.softmax(probs, dim=-1)
            out = torch.bmm(probs, v)  # (B h, T, d)
        ctx.save_for_backward(heads, probs)
        ctx.scale = scale
        return out.reshape(B, num_heads, T, D // num_heads).transpose(1, 2).reshape(B, T, D)  # (B, T, D)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward's GEMMs write into buffers (out=)
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        heads, probs = ctx.saved_tensors
        scale: float = ctx.scale
        _, BH, T, d = heads.shape
        B = grad_out.shape[0]
        h = BH // B
        with torch.autocast(grad_out.device.type, enabled=False):
            q, k, v = heads.unbind(0)
            g = grad_out.to(heads.dtype).reshape(B, T, h, d).transpose(1, 2).reshape(BH, T, d)  # dO (B h, T, d)
            grad = torch.empty_like(heads)  # (3, B h, T, d): dq, dk, dv
            dq, dk, dv = grad.unbind(0)
            torch.bmm(probs.transpose(1, 2), g, out=dv)
            dp = torch.bmm(g, v.transpose(1, 2))  # (B h, T, T)
            ds = torch._softmax_backward_data(dp, probs, -1, probs.dtype)
            dq.baddbmm_(ds, k, beta=0.0, alpha=scale)
            dk.baddbmm_(ds.transpose(1, 2), q, beta=0.0, alpha=scale)
        grad_qkv = grad.reshape(3, B, h, T, d).permute(1, 3, 0, 2, 4).reshape(B, T, 3 * h * d)  # (B, T, 3D)
        return grad_qkv, None, None, None


def softmax_attention(
    qkv: torch.Tensor, num_heads: int, scale: float, kernels: TrainingKernels | None = None
) -> torch.Tensor:
    """Multi-head attention from the fused projection ``qkv`` (B, T, 3D), laid out as (3, h, d) on the last
    axis (q, k, v, each head after head): softmax(scale q k^T) v of every head, merged to (B, T, D)."""
    out: torch.Tensor = _SoftmaxAttention.apply(qkv, num_heads, scale, kernels)
    return out
