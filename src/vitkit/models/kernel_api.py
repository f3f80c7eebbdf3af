"""The interface of the training kernels a model can be handed (``kernel_paths.set_training_kernels``).

A module of its own so that both the attention (``vitkit.models.attention``) and the fused MLP ops
(``vitkit.models.fused``, which also holds :class:`~vitkit.models.fused.TorchKernels`, the interface in
PyTorch's ops) can name it without importing each other.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TrainingKernels(Protocol):
    def gelu_supported(self, h: torch.Tensor) -> bool:
        """Whether :meth:`gelu` and :meth:`gelu_backward_bias` take activations like ``h`` (dtype, device)."""
        ...

    def gelu(self, h: torch.Tensor) -> torch.Tensor:
        """Exact GELU of a contiguous (N, C) tensor, a new tensor."""
        ...

    def gelu_backward_bias(self, grad: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dh, db): dh = grad * gelu'(h) in h's dtype, db = dh summed over rows (at least fp32)."""
        ...

    def linear_supported(self, x: torch.Tensor) -> bool:
        """Whether :meth:`linear` takes activations like ``x`` (dtype, device)."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b for x (N, K) and ``weight`` (M, K) (any strides) and ``bias`` (M,), all in x's dtype, as a
        new (N, M) tensor in that dtype (fp32 sums)."""
        ...

    def softmax_supported(self, x: torch.Tensor) -> bool:
        """Whether :meth:`softmax_` takes a tensor like ``x``."""
        ...

    def softmax_(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over the last axis of a contiguous tensor, in place; returns ``x``."""
        ...

    def attention_supported(self, qkv: torch.Tensor, num_heads: int) -> bool:
        """Whether :meth:`attention` and :meth:`attention_backward` take the projection ``qkv`` (B, T, 3D)."""
        ...

    def attention(self, qkv: torch.Tensor, num_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(scale q k^T) v of every head from ``qkv`` (B, T, 3D) as (B, T, D), and the probabilities in
        whatever form :meth:`attention_backward` takes them."""
        ...

    def attention_backward(
        self, grad: torch.Tensor, qkv: torch.Tensor, probs: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        """The gradient of ``qkv`` (B, T, 3D) given ``grad`` of the output (B, T, D) and the probabilities
        :meth:`attention` returned for it."""
        ...
