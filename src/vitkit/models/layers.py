"""The pieces of a block that the descendants of the paper's ViT vary (``vitkit.models.config``): the MLP's
activation and gating, layer scale, stochastic depth, and attention pooling (MAP). Plain ``nn.Module`` s,
shared by the model and, where they are not kernels, by the inference fast path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """GELU ("exact"), its tanh form ("tanh"), or OpenAI CLIP's QuickGELU x sigmoid(1.702 x) ("quick")."""
    if kind == "quick":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if kind == "tanh" else "none")


class Mlp(nn.Module):
    """Dense(mlp_dim) -> activation -> dropout -> Dense(D) -> dropout; with ``kind="swiglu"``, fc1 holds the gate
    and up projections stacked (mlp_dim rows each) and the hidden is silu(gate) * up. ``norm_eps``: a LayerNorm of
    the hidden activation before the second Dense (EVA-02's sub-LN, ``ViTConfig.mlp_norm``); None: none."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        gelu: str = "exact",
        dropout: float = 0.0,
        kind: str = "plain",
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.gelu = kind, gelu
        self.fc1 = nn.Linear(dim, 2 * hidden if kind == "swiglu" else hidden)
        self.drop1 = nn.Dropout(dropout)
        self.norm: nn.Module = nn.Identity() if norm_eps is None else nn.LayerNorm(hidden, eps=norm_eps)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(dropout)

    @property
    def exact_gelu(self) -> bool:
        """The paper's MLP (fc1 -> exact GELU), which the training kernels fuse."""
        return self.kind == "plain" and self.gelu == "exact"

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """fc1's output (..., fc1.out_features) -> the hidden activation (..., mlp_dim)."""
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return activation(h, self.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D)."""
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class LayerScale(nn.Module):
    """x * gamma, one learned scale per channel (CaiT; DINOv2's ``ls1``/``ls2``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: zero a residual branch for a random subset of samples, rescaling the rest."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class MapHead(nn.Module):
    """Multihead attention pooling (big_vision's ``MAPHead``, SigLIP): one learned query ``probe`` attends over
    all tokens, then a residual MLP: y = a + MLP(LN(a)), a = MHA(probe, x, x). Names as timm's
    ``AttentionPoolLatent`` (q, kv, proj, norm, mlp)."""

    def __init__(self, dim: int, num_heads: int, hidden: int, gelu: str, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.probe = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, hidden, gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T, D) -> pooled (B, D)."""
        B, T, D = x.shape
        h = self.num_heads
        q = self.q(self.probe.to(x.dtype)).expand(B, -1, -1).reshape(B, 1, h, D // h).transpose(1, 2)  # (B, h, 1, d)
        k, v = self.kv(x).reshape(B, T, 2, h, D // h).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, h, T, d)
        a = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, D))  # (B, 1, D)
        return (a + self.mlp(self.norm(a)))[:, 0]
