"""The reference peer for benchmarks: Hugging Face transformers' ``ViTForImageClassification`` holding
exactly the weights of a vitkit model.

The names and the config come from the Hugging Face checkpoint format (:mod:`vitkit.checkpoints.hf`), the
same adapter ``vitkit convert --to hf`` writes with; the peer is that folder built in memory. Both
transformers parameter layouts are handled: 5.x (``vit.layers.N.attention.q_proj``) and the classic 4.x one
(``vit.encoder.layer.N.attention.attention.query``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitkit.checkpoints import hf
from vitkit.errors import ConfigError
from vitkit.models.vit import VisionTransformer


def transformers_config(model: VisionTransformer, attn_implementation: str = "sdpa") -> Any:
    """The transformers ``ViTConfig`` describing the same classifier as ``model``."""
    from transformers import ViTConfig as HFConfig

    why = hf.unrepresentable(model.cfg) or ("no classification head" if model.cfg.num_classes <= 0 else None)
    if why:
        raise ConfigError(f"transformers' ViTForImageClassification cannot represent this model: {why}")
    config = HFConfig(**hf.hf_config(model.cfg, None))
    config._attn_implementation = attn_implementation
    return config


def to_transformers(model: VisionTransformer, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' ``ViTForImageClassification`` with ``model``'s weights, in eval mode, same device
    and dtype. ``forward(pixel_values).logits`` equals ``model(pixel_values)``."""
    from transformers import ViTForImageClassification

    ref = next(model.parameters())
    with torch.device("meta"):
        peer = ViTForImageClassification(transformers_config(model, attn_implementation))
    expected = set(peer.state_dict())
    style = "v5" if "vit.layers.0.layernorm_before.weight" in expected else "hub"
    _, sd = hf.transformers_state(model, "vit.", style)
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ConfigError(f"transformers ViT layout not recognised: missing {missing[:3]}, unexpected {unexpected[:3]}")
    peer.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True, assign=True)  # no aliasing
    module: nn.Module = peer
    return module.to(device=ref.device, dtype=ref.dtype).eval()
