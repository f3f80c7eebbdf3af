"""The training step's route through a ViT block, kept beside the model (as torchtitan keeps parallelism and
float8 outside its model): the training kernels (``vitkit.models.fused``), LoRA's fused layer
(``vitkit.models.lora.fused_lora``) and the explicit attention with its own backward pass
(``vitkit.models.attention.softmax_attention``).

The seam is :attr:`vitkit.models.vit.Block.path`: None (the default) runs the block through its own modules,
plain PyTorch; a :class:`KernelPath` computes the same two branches, MSA(LN(z)) and MLP(LN(z)), with their
GEMMs and GELU through ``kernels`` and each LayerNorm's input handed to an adapted qkv / fc1 (it recomputes its
input from it in the backward pass instead of keeping it). The block's residuals, dropouts and drop-path stay
the model's. :func:`set_training_kernels` and :func:`set_fused_attention` install it on every block of a model;
they replace what were ``VisionTransformer`` methods, with the same behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vitkit.models.attention import softmax_attention
from vitkit.models.fused import NormInput, linear, linear_gelu
from vitkit.models.kernel_api import TrainingKernels
from vitkit.models.layers import Mlp
from vitkit.models.lora import fused_lora
from vitkit.models.vit import Attention, Block, Rope

__all__ = ["KernelPath", "norm_input", "set_block_path", "set_fused_attention", "set_training_kernels"]


def _dense(
    layer: nn.Module,
    x: torch.Tensor,
    kernels: TrainingKernels | None,
    source: torch.Tensor | None = None,
    norm: NormInput | None = None,
) -> torch.Tensor:
    """``layer(x)``, its GEMMs through the training kernels' when there are any: a plain ``nn.Linear``
    (``fused.linear``) or a LoRA-adapted one (``lora.fused_lora``; ``source``: GELU's input, when x is GELU of
    it; ``norm``: the LayerNorm x is the output of); any other layer computes its own forward."""
    if kernels is None:
        return layer(x)
    if type(layer) is nn.Linear:
        return linear(x, layer.weight, layer.bias, kernels)
    out = fused_lora(layer, x, kernels, source=source, norm=norm)
    return layer(x) if out is None else out[0]


def norm_input(norm: nn.Module, x: torch.Tensor) -> NormInput | None:
    """``norm(x)`` described by its input and weights (``NormInput``); None for any other norm than a LayerNorm
    over the last dimension."""
    if type(norm) is not nn.LayerNorm or len(norm.normalized_shape) != 1:
        return None
    return NormInput(x, norm.weight, norm.bias, norm.eps)


@dataclass(frozen=True)
class KernelPath:
    """A block's two branches with ``kernels`` (None: PyTorch's ops, with the explicit attention's own backward
    pass where the block's attention is not fused): the :class:`vitkit.models.vit.BlockPath` seam."""

    kernels: TrainingKernels | None = None

    def attention(
        self, block: Block, x: torch.Tensor, return_attention: bool, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MSA(LN(x)) of ``block`` (x: (B, T, D)) and, with ``return_attention``, the probabilities (B, h, T, T)."""
        attn: Attention = block.attn
        k = self.kernels
        qkv = _dense(attn.qkv, block.norm1(x), k, norm=norm_input(block.norm1, x))  # (B, T, 3D)
        if attn.q_bias is not None:  # no key bias (DINOv3): the query's and value's beside the GEMM
            qkv = qkv + attn.qkv_bias().to(qkv.dtype)  # type: ignore[union-attr]
        p_drop = attn.attention_dropout if attn.training else 0.0
        if not (attn.fused or return_attention or p_drop or rope is not None):  # q, k, v, scale, gradients at once
            out, probs = softmax_attention(qkv, attn.num_heads, attn.scale, k), None
        else:
            out, probs = attn.attend(qkv, return_attention, rope)  # (B, T, D)
        return _dense(attn.proj, out if attn.norm is None else attn.norm(out), k), probs

    def mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """MLP(LN(x)) of ``block``: with kernels, Dense -> exact GELU is one fused op (``linear_gelu``, or
        ``fused_lora`` for an adapted fc1, whose GELU input an adapted fc2 recomputes its input from)."""
        mlp: Mlp = block.mlp
        y = block.norm2(x)
        k, h, source = self.kernels, None, None  # source: GELU's input, for an adapted fc2 (see _dense)
        if k is not None and mlp.exact_gelu:
            if type(mlp.fc1) is nn.Linear:
                h = linear_gelu(y, mlp.fc1.weight, mlp.fc1.bias, k)  # (B, T, mlp_dim)
            elif (lora := fused_lora(mlp.fc1, y, k, gelu=True, norm=norm_input(block.norm2, x))) is not None:
                h, source = lora
        if h is None:
            h = mlp.act(mlp.fc1(y))
        h = mlp.drop1(h)
        if isinstance(mlp.norm, nn.LayerNorm):  # EVA-02's sub-LN: fc2's input is no longer GELU of ``source``
            h, source = mlp.norm(h), None
        if mlp.training and mlp.drop1.p:
            source = None
        return mlp.drop2(_dense(mlp.fc2, h, k, source))  # (B, T, D)


def _blocks(model: nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


def set_block_path(block: Block, fused: bool, kernels: TrainingKernels | None) -> None:
    """One block's attention kernel (``fused``: SDPA, else the explicit softmax) and training kernels."""
    block.attn.fused = fused
    block.path = KernelPath(kernels)


def set_training_kernels(model: nn.Module, kernels: TrainingKernels | None) -> None:
    """Hand every block of ``model`` ``kernels`` (``vitkit.models.fused``) for its GEMMs, MLP and explicit
    attention, or None (PyTorch's ops)."""
    path = KernelPath(kernels)
    for blk in _blocks(model):
        blk.path = path


def set_fused_attention(model: nn.Module, fused: bool = True) -> None:
    """Choose the attention kernel of every block of ``model``: fused SDPA (default) or the explicit softmax path
    (``softmax_attention``, with its own backward pass; on CPU it trains faster than the fused kernel at ViT's
    short sequences, at the cost of storing the (B, h, T, T) probabilities)."""
    for blk in _blocks(model):
        blk.attn.fused = fused
        if blk.path is None:
            blk.path = KernelPath()
