"""The transformers peer holds exactly vitkit's weights: same logits in fp32."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_
from vitkit.bench.peers import to_transformers
from vitkit.checkpoints.hf import transformers_state
from vitkit.errors import ConfigError
from vitkit.models import create_model


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_transformers_peer_has_the_same_function(gelu: str) -> None:
    model = randomize_(create_model("Ti/16", num_classes=7, image_size=48, depth=3, gelu=gelu)).eval()
    hf = to_transformers(model)
    x = torch.randn(3, 3, 48, 48)
    with torch.no_grad():
        ours, theirs = model(x), hf(pixel_values=x).logits
    assert ours.abs().max() > 0.1  # a meaningful comparison, not zeros against zeros
    assert ((ours - theirs).norm() / ours.norm()).item() < 1e-5


def test_classic_hub_layout_names() -> None:
    model = create_model("Ti/16", num_classes=5, image_size=32, depth=1)
    _, sd = transformers_state(model, "vit.", "hub")
    for key in (
        "vit.encoder.layer.0.attention.attention.query.weight",
        "vit.encoder.layer.0.attention.output.dense.bias",
        "vit.encoder.layer.0.intermediate.dense.weight",
        "vit.encoder.layer.0.output.dense.weight",
    ):
        assert key in sd
    D = model.cfg.hidden_size
    assert torch.equal(
        sd["vit.encoder.layer.0.attention.attention.value.weight"], model.blocks[0].attn.qkv.weight[2 * D :]
    )


def test_unrepresentable_config_is_a_clear_error() -> None:
    model = create_model("Ti/16", num_classes=5, image_size=32, depth=1, classifier="gap")
    with pytest.raises(ConfigError, match="gap"):
        to_transformers(model)
