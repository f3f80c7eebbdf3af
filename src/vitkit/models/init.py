"""Weight initialisers shared by the ViT and its hybrid ResNet stem (Flax's conventions)."""

from __future__ import annotations

import math

import torch
from torch import nn


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Flax's ``lecun_normal``: truncated normal (+-2 std) with variance 1 / fan_in after truncation."""
    fan_in = w.shape[1] * math.prod(w.shape[2:]) if w.ndim > 1 else w.shape[0]
    # std of a unit normal truncated to [-2, 2] is 0.87962566103423978; divide to undo the shrinkage
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)
