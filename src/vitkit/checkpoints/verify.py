"""Numerical comparison of two models on the same random images (used to prove conversions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vitkit.models.vit import VisionTransformer


@dataclass(frozen=True)
class Agreement:
    max_abs_err: float
    rel_err: float  # ||a - b|| / ||b||


@torch.no_grad()
def compare_models(reference: VisionTransformer, other: VisionTransformer, batch: int = 2, seed: int = 0) -> Agreement:
    """Outputs of ``other`` against ``reference`` on ``batch`` random images at the reference's resolution."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, reference.cfg.in_channels, *reference.cfg.image_size, generator=gen)
    a, b = other.eval()(x).double(), reference.eval()(x).double()
    denom = float(b.norm()) or 1.0
    return Agreement(float((a - b).abs().max()), float((a - b).norm()) / denom)
