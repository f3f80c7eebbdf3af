"""Fused training ops whose elementwise kernels are supplied from outside the model.

The model stays a plain ``nn.Module``: it never compiles or loads anything. Whoever trains it (the trainer,
``vitkit bench --task train``) may hand every block a :class:`TrainingKernels` object
(``vitkit.models.kernel_paths.set_training_kernels``; on CPU, ``vitkit.train.kernels.load``, hand-written AVX-512
kernels). With one set, the MLP runs fc1 -> GELU as :func:`linear_gelu` and the explicit attention
(``vitkit.models.attention``) takes its whole forward and backward pass, or only its softmax, from it;
without one (the default)
nothing changes. :class:`TorchKernels` is the same interface in plain PyTorch: the reference the kernels are
tested against.

:func:`linear_gelu`: y = gelu(x W^T + b) (exact, erf GELU) with a backward pass that computes the GELU
gradient and the bias gradient (its sum over rows) in one pass over the activations, where PyTorch's
autograd takes two (GELU backward, then the Linear's bias-gradient sum):

    h = x W^T + b,  y = h Phi(h);  dh = dy (Phi(h) + h phi(h)),  db = sum_rows dh,  dx = dh W,  dW = dh^T x.

Under autocast it casts x, W and b to the autocast dtype as autocast's own Linear does; its forward and
input-gradient GEMMs run through ``kernels.linear`` where it takes the activations (else ``addmm`` / ``mm``),
the weight gradient through ``mm``; gradients come back in the parameters' dtypes.

:func:`linear`: F.linear with the same GEMM routing (the blocks' qkv, proj and fc2 when kernels are set):
on CPU, oneDNN's GEMM on the weight reordered into its blocked layout once per pass, forward (W) and
backward (W^T for dx = dy W) -- ~1.2x the rate of ``addmm`` / ``mm`` on the plain weight (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from vitkit.models.attention import attention_backward_reference, attention_reference
from vitkit.models.kernel_api import TrainingKernels

__all__ = ["LoraAdapter", "NormInput", "TorchKernels", "TrainingKernels", "linear", "linear_gelu", "lora_linear"]


class TorchKernels:
    """:class:`TrainingKernels` in PyTorch's own ops, for any dtype and device."""

    def _takes_any(self, *args: Any, **kwargs: Any) -> bool:
        return True

    gelu_supported = linear_supported = softmax_supported = attention_supported = _takes_any

    def gelu(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h)

    def gelu_backward_bias(self, grad: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dh = torch.ops.aten.gelu_backward(grad, h)
        return dh, dh.sum(0, dtype=torch.promote_types(dh.dtype, torch.float32))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def softmax_(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.softmax(x, dim=-1))

    def attention(self, qkv: torch.Tensor, num_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return attention_reference(qkv, num_heads, scale)

    def attention_backward(
        self, grad: torch.Tensor, qkv: torch.Tensor, probs: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        return attention_backward_reference(grad, qkv, probs, num_heads, scale)


class _Linear(torch.autograd.Function):
    """x W^T + b with its GEMMs through ``kernels`` (:func:`linear`), or with ``gelu`` exact GELU of it, whose
    backward pass computes GELU's and the bias's gradients in one (``gelu_backward_bias``; :func:`linear_gelu`,
    its forward GEMM ``addmm`` where the kernels' does not take x); dx goes through the forward's GEMM."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: TrainingKernels, gelu: bool
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (N, D_in)
        w = weight.to(x.dtype)  # (D_out, D_in)
        b = None if bias is None else bias.to(x.dtype)
        ctx.gemm = not gelu or kernels.linear_supported(x2)
        # (addmm only for gelu: linear routes gelu here only with a bias)
        h = kernels.linear(x2, w, b) if ctx.gemm else torch.addmm(b, x2, w.t())  # type: ignore[arg-type]
        ctx.save_for_backward(x2, w, h if gelu else None)
        ctx.kernels, ctx.lead, ctx.gelu = kernels, lead, gelu
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return (kernels.gelu(h) if gelu else h).reshape(*lead, h.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, h = ctx.saved_tensors
        g = grad.reshape(-1, w.shape[0]).to(w.dtype).contiguous()  # (N, D_out)
        need_x, need_w, need_b, _, _ = ctx.needs_input_grad
        if ctx.gelu:
            g, db = ctx.kernels.gelu_backward_bias(g, h)  # dh, and its sum over rows
        else:
            db = g.sum(0) if need_b else None  # as autograd's (sum(dtype=fp32) is 5-50x slower)
        dx = None
        if need_x:  # grad W: (N, D_out) x (D_out, D_in), through the kernels' GEMM where the forward pass used it
            dx = (ctx.kernels.linear(g, w.t(), None) if ctx.gemm else torch.mm(g, w)).reshape(*ctx.lead, w.shape[1])
        dw = torch.mm(g.t(), x2).to(ctx.dtypes[0]) if need_w else None
        return dx, dw, db.to(ctx.dtypes[1]) if need_b else None, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: TrainingKernels, *, gelu: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias), with ``gelu`` then exact GELU (:func:`linear_gelu`), with its GEMMs (forward,
    input gradient) through ``kernels`` where they take the activations (autocast applied as for a Linear), else
    through PyTorch's ops."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
        fits = True
    else:
        fits = weight.dtype == x.dtype  # else as F.linear would: no silent promotion
    probe = x.new_empty(0)
    supported = bias is not None and kernels.gelu_supported(probe) if gelu else kernels.linear_supported(probe)
    if fits and supported:
        with torch.autocast(device, enabled=False):
            out: torch.Tensor = _Linear.apply(x, weight, bias, kernels, gelu)
        return out
    y = F.linear(x, weight, bias)
    return F.gelu(y) if gelu else y


def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: TrainingKernels
) -> torch.Tensor:
    """gelu(F.linear(x, weight, bias)) (exact GELU): :func:`linear` with ``gelu``."""
    return linear(x, weight, bias, kernels, gelu=True)


class LoraAdapter(NamedTuple):
    """One low-rank adapter of a Linear layer: ``a`` (r, D_in), ``b`` (D_out, r), ``scale`` (alpha / r) and the
    dropout on its input (peft's ``lora_A`` / ``lora_B`` weights, ``scaling`` and ``lora_dropout``)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    dropout: Callable[[torch.Tensor], torch.Tensor]


class NormInput(NamedTuple):
    """What a layer's input x was computed from: ``F.layer_norm(input, input.shape[-1:], weight, bias, eps)`` under
    the autocast state of the call that takes x (``kernel_paths.KernelPath`` hands a block's norms' to qkv and fc1)."""

    input: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    def kept_by_norm(self) -> bool:
        """Whether the LayerNorm's backward pass keeps ``input`` (it does when it computes any gradient)."""
        grads = (t is not None and t.requires_grad for t in (self.input, self.weight, self.bias))
        return torch.is_grad_enabled() and any(grads)


class _Recompute(NamedTuple):
    """How the backward pass gets the adapter's input back: ``"gelu"`` (GELU of the kept tensor) or ``"norm"``
    (the LayerNorm of it, with ``eps``, autocast on or off and its dtype, then cast to ``dtype``)."""

    kind: str
    eps: float = 0.0
    autocast: bool = False
    autocast_dtype: torch.dtype = torch.bfloat16
    dtype: torch.dtype = torch.float32


class _LoraOptions(NamedTuple):
    """The non-tensor arguments of :class:`_LoraLinear`."""

    scale: float
    kernels: TrainingKernels
    gelu: bool
    recompute: _Recompute | None


def _adapter_input(ctx: Any, kept: torch.Tensor, nw: torch.Tensor | None, nb: torch.Tensor | None) -> torch.Tensor:
    """The adapter's input (N, D_in) as the forward pass had it: kept, or recomputed by the same ops and casts."""
    r: _Recompute | None = ctx.recompute
    if r is None:
        return kept
    if r.kind == "gelu":
        return ctx.act.gelu(kept.reshape(-1, kept.shape[-1]))
    with torch.autocast(kept.device.type, dtype=r.autocast_dtype, enabled=r.autocast):
        xn = F.layer_norm(kept, kept.shape[-1:], nw, nb, r.eps)
    return xn.to(r.dtype).reshape(-1, kept.shape[-1])


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + b + scale (xd A^T) B^T (then GELU) on a frozen W, b; keeps x A^T, GELU's input and xd, or what
    xd is recomputed from (``recompute``: GELU's input, or a LayerNorm's input and weights, kept anyway by the
    layers before), never a copy of W (recast there)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        xd: torch.Tensor | None,
        kept: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        norm_weight: torch.Tensor | None,
        norm_bias: torch.Tensor | None,
        opts: _LoraOptions,
    ) -> Any:
        x2 = x.reshape(-1, x.shape[-1])  # (N, D_in)
        xd2 = x2 if xd is None else xd.reshape(x2.shape)  # the adapter's input: x after dropout
        kernels = opts.kernels
        ctx.kernels = kernels if kernels.linear_supported(x2) else TorchKernels()
        y = ctx.kernels.linear(x2, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))  # (N, D_out)
        xa = torch.mm(xd2, a.to(x.dtype).t())  # (N, r)
        y.addmm_(xa, b.to(x.dtype).t(), alpha=opts.scale)
        ctx.act = kernels if kernels.gelu_supported(y) else TorchKernels()
        ctx.recompute = opts.recompute if xd is None else None  # dropout's mask is not kept: xd is
        saved = kept if ctx.recompute is not None else xd2
        ctx.save_for_backward(saved, xa, y if opts.gelu else None, weight, a, b, norm_weight, norm_bias)
        ctx.lead, ctx.scale, ctx.dropout, ctx.gelu = x.shape[:-1], opts.scale, xd is not None, opts.gelu
        if not opts.gelu:
            return y.reshape(*ctx.lead, y.shape[1])
        ctx.mark_non_differentiable(y)
        return ctx.act.gelu(y).reshape(*ctx.lead, y.shape[1]), y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        kept, xa, h, weight, a, b, nw, nb = ctx.saved_tensors
        g = grad.reshape(-1, b.shape[0]).to(xa.dtype).contiguous()  # (N, D_out)
        if ctx.gelu:
            g = ctx.act.gelu_backward_bias(g, h)[0]
        xd2 = _adapter_input(ctx, kept, nw, nb)  # (N, D_in)
        need_x, need_xd, _, _, _, need_a, need_b = ctx.needs_input_grad[:7]
        gb = torch.mm(g, b.to(g.dtype))  # (N, r)
        da = torch.mm(gb.t(), xd2).mul_(ctx.scale).to(a.dtype) if need_a else None
        db = torch.mm(g.t(), xa).mul_(ctx.scale).to(b.dtype) if need_b else None
        dx = dxd = None
        if need_x:  # through the kernels' GEMM where the forward pass used it; the adapter's share added in place
            dx = ctx.kernels.linear(g, weight.to(g.dtype).t(), None)
            if not ctx.dropout:
                dx.addmm_(gb, a.to(g.dtype), alpha=ctx.scale)
            dx = dx.reshape(*ctx.lead, a.shape[1])
        if ctx.dropout and need_xd:
            dxd = torch.mm(gb, a.to(g.dtype)).mul_(ctx.scale).reshape(*ctx.lead, a.shape[1])
        return dx, dxd, None, None, None, da, db, None, None, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    adapter: LoraAdapter,
    kernels: TrainingKernels,
    *,
    gelu: bool = False,
    source: torch.Tensor | None = None,
    norm: NormInput | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A LoRA-adapted Linear on a frozen ``weight``/``bias``: ``F.linear(x, weight, bias) + scale B A
    dropout(x)``, then exact GELU with ``gelu``; the base GEMMs through ``kernels`` where they take the
    activations (autocast applied as for a Linear), no weight gradient and no copy of ``weight`` kept. Returns
    the output and, with ``gelu``, GELU's input (give it as ``source`` to the layer that takes this output
    unchanged: that layer then recomputes its input in the backward pass instead of keeping it). ``norm``: x is
    that LayerNorm's output; where the LayerNorm's backward keeps its input anyway, the adapter's input is
    recomputed from it in the backward pass (the same ops and casts: bitwise the forward's) instead of kept.
    None where the dtypes differ without autocast (as F.linear, no silent promotion): the caller runs the
    layer's own forward."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    if not autocast and not weight.dtype == adapter.a.dtype == x.dtype:
        return None
    dropped = adapter.dropout(x)  # peft's order: dropout on the input as given, then any cast
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    xd = None if dropped is x else dropped.to(dtype)  # None: the adapter takes x itself
    kept, recompute = source, None
    norm_weights: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if source is not None:
        recompute = _Recompute("gelu")
    elif norm is not None and norm.kept_by_norm():
        kept, norm_weights = norm.input, (norm.weight, norm.bias)
        recompute = _Recompute("norm", norm.eps, autocast, torch.get_autocast_dtype(device), dtype)
    opts = _LoraOptions(adapter.scale, kernels, gelu, recompute)
    with torch.autocast(device, enabled=False):
        out = _LoraLinear.apply(x.to(dtype), xd, kept, weight, bias, adapter.a, adapter.b, *norm_weights, opts)
    return (out[0], out[1]) if gelu else (out, None)
