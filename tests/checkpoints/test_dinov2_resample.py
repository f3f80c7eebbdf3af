"""The official DINOv2 format at a non-native size: 518 px weights run at 224 px resample the position grid as
facebookresearch/dinov2's ``interpolate_pos_encoding`` does (bicubic, no antialias, the scale factor
``(n + 0.1) / M``: its default ``interpolate_offset=0.1``). The reference is transformers' Dinov2Model on a folder
written from the official file, its own resampling replaced by the official code's (written out below from
dinov2/models/vision_transformer.py); transformers' own size-based resampling, which the ``hf`` format follows, is
measured beside it."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_dinov2_official import official_file, vt

from helpers import rel_err
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.models.posembed import resample_grid

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")


def official_offset_resample(pos: torch.Tensor, w0: int, h0: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """facebookresearch/dinov2's interpolate_pos_encoding (interpolate_offset 0.1, interpolate_antialias False) on a
    (1, 1 + M*M, D) table, for a grid of w0 x h0 patches, as that code writes it (the width's factor on the rows;
    in float32 there, ``dtype`` here)."""
    N = pos.shape[1] - 1
    M = int(math.sqrt(N))
    patch = pos[:, 1:].to(dtype).reshape(1, M, M, -1).permute(0, 3, 1, 2)
    sx, sy = float(w0 + 0.1) / M, float(h0 + 0.1) / M
    out = F.interpolate(patch, scale_factor=(sx, sy), mode="bicubic", antialias=False)
    assert (w0, h0) == out.shape[-2:]
    return torch.cat([pos[:, :1].to(dtype), out.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1])], dim=1)


def test_518_weights_at_224_give_the_official_code_s_features(tmp_path: Path) -> None:
    path, _ = official_file(tmp_path, 0, img_size=518)
    ckpt = load_checkpoint(path)
    model = ckpt.model.eval()
    assert model.cfg.image_size == (518, 518) and model.cfg.pos_resample == "bicubic_offset"
    folder = save_checkpoint(model, tmp_path / "hf", "hf", meta=ckpt.meta)
    ref = transformers.Dinov2Model.from_pretrained(folder, attn_implementation="eager").eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        plain = ref(pixel_values=x)  # transformers' own resampling (to the size)

        def official(self: object, embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
            return official_offset_resample(ref.embeddings.position_embeddings, width // 14, height // 14)

        ref.embeddings.interpolate_pos_encoding = types.MethodType(official, ref.embeddings)
        theirs = ref(pixel_values=x)
        ours, tokens = model(x), model.forward_features(x)
    err, tokens_err = rel_err(ours, theirs.pooler_output), rel_err(tokens, theirs.last_hidden_state)
    gap = rel_err(plain.pooler_output, theirs.pooler_output)
    print(f"dinov2 518->224: pooled {err:.2e}, tokens {tokens_err:.2e}; transformers' size-based one {gap:.2e} away")
    assert err <= 1e-5 and tokens_err <= 1e-5
    assert gap > 100 * err  # the two resamplings differ measurably: the comparison can tell them apart


def test_the_offset_resampling_is_the_official_formula_on_square_grids() -> None:
    """resample_grid's "bicubic_offset" against the official code's formula, 37x37 -> 16x16 and 37x37 -> 40x40
    (smaller and larger), and apart from the size-based resampling."""
    pos = torch.randn(1, 1 + 37 * 37, 24, dtype=torch.float64)
    for n in (16, 40):
        ours = resample_grid(pos, (37, 37), (n, n), 1, "bicubic_offset")
        theirs = official_offset_resample(pos, n, n, torch.float64)
        assert ours.shape == (1, 1 + n * n, 24)
        assert rel_err(ours, theirs) <= 1e-14  # the same formula (in float64 on both sides)
        assert rel_err(ours, official_offset_resample(pos, n, n)) <= 1e-5  # the official code's float32
        assert rel_err(ours, resample_grid(pos, (37, 37), (n, n), 1, "bicubic_plain")) > 1e-2
