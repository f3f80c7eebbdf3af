"""``analyze`` on the modern families: registers and a distillation token are left out of the patch grid (maps of the
grid's shape, distances over patch tokens only), the position embedding of a registers model is its patch part, and
a RoPE model (no position embedding) skips that figure."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import randomize_
from vitkit.analysis.analyze import AnalyzeOptions, analyze, attention_analysis
from vitkit.analysis.attention_maps import attention_maps, rollout_maps
from vitkit.analysis.embeddings import position_embeddings
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.inference.features import ExtractOptions

BASE = {"image_size": (16, 24), "patch_size": 4, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32}
REGISTERS = {"num_registers": 4, "layer_scale": 0.5}  # DINOv2-reg4: [class, 4 registers, patches]


def model_with(**kw: Any) -> Any:
    torch.manual_seed(0)
    return randomize_(vitkit.create_model("Ti/16", **BASE, num_classes=3, **kw), std=0.3).eval()


def direct_distance(attn: torch.Tensor, prefix: int, grid: tuple[int, int], stride: int) -> np.ndarray:
    """(h,) mean attention distance of one image's (h, T, T) probabilities, by loops over patch pairs."""
    a = attn.double().numpy()
    gh, gw = grid
    out = np.zeros(a.shape[0])
    for head in range(a.shape[0]):
        total = 0.0
        for q in range(gh * gw):
            w = a[head, prefix + q, prefix:]
            w = w / w.sum()
            d = [math.dist(divmod(q, gw), divmod(k, gw)) * stride for k in range(gh * gw)]
            total += float(np.dot(w, d))
        out[head] = total / (gh * gw)
    return out


@pytest.mark.parametrize("kw", [REGISTERS, {**REGISTERS, "distilled": True}])
def test_maps_are_the_patch_grid_and_distances_skip_every_prefix_token(kw: dict[str, Any]) -> None:
    model = model_with(**kw)
    prefix = model.cfg.num_prefix_tokens
    assert prefix == 5 + int(model.cfg.distilled)
    grid, x = model.cfg.grid_size, torch.randn(3, 3, 16, 24)
    res = attention_analysis(model, [x[:2], x[2:]], AnalyzeOptions(max_overlays=3), progress=False)
    assert res.rollout.shape == (3, 16, 24) and res.layer_maps.shape == (3, 2, 16, 24)
    with torch.no_grad():
        attns = model.forward_intermediates(x).attentions  # L x (B, h, T, T)
    assert attns[0].shape[-1] == prefix + grid[0] * grid[1]
    want = np.mean([[direct_distance(a[b], prefix, grid, 4) for a in attns] for b in range(3)], axis=0)  # (L, h)
    np.testing.assert_allclose(res.mean_distance, want, rtol=1e-9)
    maps = attention_maps(attns[-1], grid, prefix)  # the class token's row over the patch keys
    assert maps.shape == (3, 2, *grid)
    np.testing.assert_array_equal(maps.numpy(), attns[-1][:, :, 0, prefix:].reshape(3, 2, *grid).numpy())


def test_registers_without_a_class_token_average_the_patch_queries() -> None:
    model = model_with(classifier="map", class_token=False, num_registers=4)
    grid, x = model.cfg.grid_size, torch.randn(2, 3, 16, 24)
    with torch.no_grad():
        attn = model.forward_intermediates(x).attentions[-1]
    maps = attention_maps(attn, grid, 4, class_token=False)  # row 0 is a register: no query of its own
    want = attn[:, :, 4:, 4:].mean(dim=-2).reshape(2, 2, *grid)
    torch.testing.assert_close(maps, want, rtol=0, atol=0)
    assert rollout_maps([attn], grid, 4, class_token=False).shape == (2, *grid)


def test_position_embedding_of_a_registers_model_is_its_patch_part() -> None:
    model = model_with(**REGISTERS, distilled=True)
    assert model.pos_embed is not None and model.pos_embed.shape[1] == 2 + 24  # registers have no slot
    pe, grid = position_embeddings(model)
    assert grid == (4, 6)
    np.testing.assert_array_equal(pe, model.pos_embed[0, 2:].detach().double().numpy())


@pytest.mark.parametrize(
    "kw", [REGISTERS, {"pos_embed": "none", "rope": "dinov3", "key_bias": False, **REGISTERS}], ids=["reg4", "rope"]
)
def test_analyze_writes_the_report_for_a_registers_model(tmp_path: Path, kw: dict[str, Any]) -> None:
    model = model_with(**kw)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)) for _ in range(2)]
    pre = Preprocess(image_size=(16, 24))
    summary = analyze(model, pre, images, ["a", "b"], tmp_path / "out", run=ExtractOptions(progress=False))
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk["attention_distance"]["prefix_tokens_excluded"] == 5
    assert np.asarray(summary["attention_distance"]["per_layer_head"]).shape == (2, 2)
    if model.cfg.pos_embed == "none":
        assert "RoPE" in on_disk["position_embedding"]["skipped"]
    else:
        assert (tmp_path / "out" / on_disk["position_embedding"]["figure"]).is_file()
