"""The official DINOv2 format at a non-native size: 518 px weights run at 224 px resample the position grid as
transformers' Dinov2Model does (plain bicubic to the new grid, as the hf format loads DINOv2), so the official
file and the transformers folder of the same weights give the same features. The reference is transformers'
own forward on a folder written from the official file; the official code's 0.1-offset variant is measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_dinov2_official import official_file, vt

from helpers import rel_err
from vitkit.checkpoints import load_checkpoint, save_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")


def official_offset_resample(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """facebookresearch/dinov2's interpolate_pos_encoding (interpolate_offset 0.1, no antialias) on (1, 1+M*M, D)."""
    M = math.isqrt(pos.shape[1] - 1)
    patch = pos[:, 1:].reshape(1, M, M, -1).permute(0, 3, 1, 2).float()
    scale = (grid + 0.1) / M
    out = F.interpolate(patch, scale_factor=(scale, scale), mode="bicubic", antialias=False)
    return torch.cat([pos[:, :1], out.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1)


def test_518_weights_at_224_match_transformers(tmp_path: Path) -> None:
    path, _ = official_file(tmp_path, 0, img_size=518)
    ckpt = load_checkpoint(path)
    model = ckpt.model.eval()
    assert model.cfg.image_size == (518, 518) and model.cfg.pos_resample == "bicubic_plain"
    folder = save_checkpoint(model, tmp_path / "hf", "hf", meta=ckpt.meta)
    ref = transformers.Dinov2Model.from_pretrained(folder, attn_implementation="eager").eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ours = model(x)
        theirs = ref(pixel_values=x).pooler_output
        tokens_err = rel_err(model.forward_features(x), ref(pixel_values=x).last_hidden_state)
    err = rel_err(ours, theirs)
    # the official code's scale-factor variant: how far it sits from the size-based resampling (not asserted)
    grid = 224 // 14
    plain = model.pos_embed.detach()
    offset_gap = rel_err(official_offset_resample(plain, grid), transformers_like(plain, grid))
    print(f"dinov2 518->224: pooled {err:.2e}, tokens {tokens_err:.2e}; 0.1-offset table vs plain {offset_gap:.2e}")
    assert err <= 1e-5 and tokens_err <= 1e-5


def transformers_like(pos: torch.Tensor, grid: int) -> torch.Tensor:
    M = math.isqrt(pos.shape[1] - 1)
    patch = pos[:, 1:].reshape(1, M, M, -1).permute(0, 3, 1, 2).float()
    out = F.interpolate(patch, size=(grid, grid), mode="bicubic", align_corners=False, antialias=False)
    return torch.cat([pos[:, :1], out.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1)
