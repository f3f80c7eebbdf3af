"""serve and the demo with the descendants' options: attention maps of a model with registers but no class token
are queried by the patch tokens (not by a register), and a RoPE model's demo figures say why it has no position
embedding figure instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from helpers import randomize_
from vitkit.analysis.attention_maps import rollout_maps, upsample_maps
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.checkpoints.vitkit_format import save
from vitkit.models import create_model
from vitkit.serve.demo import model_figures
from vitkit.serve.served_model import ServedModel

SIZE = {"image_size": 16, "patch_size": 4, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 48}


def served(tmp_path: Path, **options: object) -> ServedModel:
    torch.manual_seed(0)
    model = randomize_(create_model("Ti/16", num_classes=3, **SIZE, **options), std=0.2).eval()
    path = save(model, tmp_path / "m", preprocess=Preprocess(image_size=16))
    return ServedModel.from_checkpoint(path, precision="fp32", max_batch=2)


def test_rollout_without_a_class_token_is_queried_by_the_patches(tmp_path: Path) -> None:
    s = served(tmp_path, classifier="map", num_registers=2)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        attns = s.model.forward_intermediates(x).attentions
    want = upsample_maps(rollout_maps(attns, (4, 4), 2, class_token=False), (16, 16)).numpy()
    register_row = upsample_maps(rollout_maps(attns, (4, 4), 2, class_token=True), (16, 16)).numpy()
    got = s.rollout(x)
    assert got.shape == (2, 16, 16)
    assert abs(got - want).max() < 1e-5
    assert abs(got - register_row).max() > 1e-3  # the two queries really differ on this model


def test_demo_figures_of_a_rope_model(tmp_path: Path) -> None:
    s = served(tmp_path, pos_embed="none", rope="dinov3", classifier="gap")
    figs = model_figures(s, tmp_path)
    assert isinstance(figs["position"], str) and "RoPE" in figs["position"]
    assert isinstance(figs["filters"], Path) and figs["filters"].is_file()


def test_the_demo_page_of_a_rope_model_says_why_and_draws_no_broken_image(tmp_path: Path) -> None:
    """The page put the position figure's message into a gr.Image (an image of a file named by the message)."""
    pytest.importorskip("gradio")
    from vitkit.serve.demo import build_demo

    demo = build_demo(served(tmp_path, pos_embed="none", rope="dinov3", classifier="gap"), tmp_path)
    blocks = list(demo.blocks.values())
    assert not any(getattr(c, "label", None) == "Position-embedding similarity" for c in blocks)
    notes = [c.value for c in blocks if type(c).__name__ == "Markdown" and "Position-embedding" in str(c.value)]
    assert len(notes) == 1 and "not shown" in notes[0] and "RoPE" in notes[0]
    assert any(getattr(c, "label", None) == "Patch-embedding filters (PCA)" for c in blocks)
