"""Batch-level regularisation: Mixup, CutMix and label smoothing, producing soft targets.

Each image is mixed with its partner in the reversed batch (``x.flip(0)``), one mixing ratio per batch
drawn from Beta(alpha, alpha) (Mixup: Zhang et al. 2018; CutMix: Yun et al. 2019). The draws come from a
numpy Generator passed in, so a step's mixing is a pure function of (seed, step, rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def one_hot_smooth(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """(B,) int -> (B, K) targets: 1 - smoothing + smoothing/K on the label, smoothing/K elsewhere."""
    off = smoothing / num_classes
    t = torch.full((labels.shape[0], num_classes), off, dtype=torch.float32, device=labels.device)
    return t.scatter_(1, labels[:, None], 1.0 - smoothing + off)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a box with area ~ (1 - lam) of the image, centred uniformly, clipped."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    top, bottom = max(cy - ch // 2, 0), min(cy + ch // 2, height)
    left, right = max(cx - cw // 2, 0), min(cx + cw // 2, width)
    return top, bottom, left, right


@dataclass(frozen=True)
class Mixer:
    """Mixup/CutMix with probability ``prob`` per batch; when both are on, CutMix with ``switch_prob``."""

    num_classes: int
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.0

    @property
    def active(self) -> bool:
        return self.prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)

    def __call__(
        self, x: torch.Tensor, labels: torch.Tensor, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, C, H, W) and labels (B,) -> mixed images and soft targets (B, K) (rows sum to 1)."""
        target = one_hot_smooth(labels, self.num_classes, self.label_smoothing)
        if not self.active or rng.random() >= self.prob:
            return x, target
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch_prob)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(rng.beta(alpha, alpha))
        partner = x.flip(0)
        if use_cutmix:
            H, W = x.shape[-2:]
            top, bottom, left, right = cutmix_box(H, W, lam, rng)
            x = x.clone()
            x[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
            lam = 1.0 - (bottom - top) * (right - left) / (H * W)  # the area actually pasted
        else:
            x = lam * x + (1.0 - lam) * partner
        return x, lam * target + (1.0 - lam) * target.flip(0)


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, kind: str = "softmax") -> torch.Tensor:
    """Mean over the batch of softmax cross-entropy, or of sigmoid cross-entropy summed over classes."""
    logits = logits.float()
    if kind == "sigmoid":
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1).mean()
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
