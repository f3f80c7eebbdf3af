"""Rotary position embedding (RoPE) on the patch tokens, as DINOv3 applies it (``ViTConfig.rope = "dinov3"``) and
as EVA-02 does (``"eva"``, :func:`eva_rope_tables`).

Each patch's centre gets coordinates in [-1, 1] (row y, column x: (i + 0.5) / n * 2 - 1, each axis normalised by
its own length, so any grid size works). With head width d there are d/4 frequencies
``theta ** -(4 k / d)``, k = 0..d/4-1; the angles ``2 pi [y f; x f]`` (d/2 of them) are repeated twice to d
channels, and q and k of every patch token are rotated by them (``x cos + rotate_half(x) sin``); the prefix
tokens (class, registers) are left as they are. This is ``DINOv3ViTRopePositionEmbedding`` and
``apply_rotary_pos_emb`` of transformers, computed in fp32; the training-time coordinate augmentations (shift,
jitter, rescale) are not applied (inference and fine-tuning at fixed coordinates).
"""

from __future__ import annotations

import math

import torch


def rope_tables(
    grid: tuple[int, int], head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (gh * gw, head_dim) in fp32, for a patch grid (gh, gw)."""
    gh, gw = grid
    f32 = {"dtype": torch.float32, "device": device}
    ys = torch.arange(0.5, gh, **f32) / gh  # type: ignore[arg-type]
    xs = torch.arange(0.5, gw, **f32) / gw  # type: ignore[arg-type]
    coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1).flatten(0, 1) * 2.0 - 1.0  # (N, 2)
    inv_freq = 1 / theta ** torch.arange(0, 1, 4 / head_dim, **f32)  # type: ignore[arg-type]  # (d/4,)
    angles = (2 * math.pi * coords[:, :, None] * inv_freq[None, None, :]).flatten(1, 2).tile(2)  # (N, d)
    return angles.cos(), angles.sin()


def eva_rope_tables(
    grid: tuple[int, int],
    head_dim: int,
    theta: float,
    ref_grid: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EVA-02's tables (timm's ``RotaryEmbeddingCat``), (cos, sin) each (gh * gw, head_dim) in fp32: patch (i, j)
    has coordinates (i, j), scaled to ``ref_grid`` when given (i / gh * ref_h: EVA-02's ``ref_feat_shape``, so a
    fine-tuned grid spans the pre-training one); frequencies ``theta ** -(k / n)``, k = 0..n-1, n = d/4; angles
    ``[y f; x f]`` (no 2 pi) repeated twice to d channels, as :func:`rope_tables`.

    timm rotates interleaved pairs (channels 2m, 2m+1); vitkit's half rotation pairs m with m + d/2. The two agree
    once q's and k's channels of every head are reordered evens first, then odds (``checkpoints.timm_eva02`` does
    it to the weights, so the model here is the same function)."""
    gh, gw = grid
    ys = torch.arange(gh, dtype=torch.float32, device=device)
    xs = torch.arange(gw, dtype=torch.float32, device=device)
    if ref_grid is not None:
        ys, xs = ys / gh * ref_grid[0], xs / gw * ref_grid[1]
    coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1).flatten(0, 1)  # (N, 2)
    n = head_dim // 4
    inv_freq = 1 / theta ** (torch.arange(n, dtype=torch.float32, device=device) / n)  # (d/4,)
    angles = (coords[:, :, None] * inv_freq[None, None, :]).flatten(1, 2).tile(2)  # (N, d)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., N, d) rotated by the tables (N, d), in x's dtype."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)
