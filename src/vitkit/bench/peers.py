"""The reference peer for benchmarks: Hugging Face transformers' ``ViTForImageClassification`` holding
exactly the weights of a vitkit model.

This is a minimal, self-contained weight copy for the classic configuration (class token, learned
position embedding, no pre-logits layer), enough to run both implementations side by side on the same
function. It handles both transformers parameter layouts: 5.x (``vit.layers.N.attention.q_proj``) and
the classic 4.x one (``vit.encoder.layer.N.attention.attention.query``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitkit.errors import ConfigError
from vitkit.models.vit import Block, VisionTransformer

# vitkit block parameter -> (transformers 5.x name, transformers 4.x name), relative to the layer
_BLOCK_NAMES = {
    "norm1": ("layernorm_before", "layernorm_before"),
    "norm2": ("layernorm_after", "layernorm_after"),
    "proj": ("attention.o_proj", "attention.output.dense"),
    "fc1": ("mlp.fc1", "intermediate.dense"),
    "fc2": ("mlp.fc2", "output.dense"),
}
_QKV_NAMES = (
    ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
)


def transformers_config(model: VisionTransformer, attn_implementation: str = "sdpa") -> Any:
    """The transformers ``ViTConfig`` describing the same architecture as ``model``."""
    from transformers import ViTConfig as HFConfig

    cfg = model.cfg
    problems = []
    if cfg.classifier != "token":
        problems.append("classifier 'gap'")
    if cfg.pos_embed != "learned":
        problems.append("sin-cos position embeddings")
    if cfg.representation_size:
        problems.append("a pre-logits layer")
    if cfg.num_classes <= 0:
        problems.append("no classification head")
    if cfg.image_size[0] != cfg.image_size[1]:
        problems.append("a non-square image size")
    if type(model.patch_embed).__name__ != "PatchEmbed":
        problems.append("a hybrid stem")
    if problems:
        raise ConfigError(f"transformers' ViTForImageClassification cannot represent {', '.join(problems)}")
    kwargs: dict[str, Any] = {
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu_pytorch_tanh" if cfg.gelu == "tanh" else "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "layer_norm_eps": cfg.layer_norm_eps,
        "image_size": cfg.image_size[0],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_channels,
        "qkv_bias": cfg.qkv_bias,
        "num_labels": cfg.num_classes,
    }
    hf = HFConfig(**kwargs)
    hf._attn_implementation = attn_implementation
    return hf


def transformers_state_dict(model: VisionTransformer, layout: str = "5") -> dict[str, torch.Tensor]:
    """vitkit weights under transformers' names (``layout`` "5": 5.x names, "4": classic hub names)."""
    new = layout == "5"
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.layernorm.weight": sd["norm.weight"],
        "vit.layernorm.bias": sd["norm.bias"],
        "classifier.weight": sd["head.weight"],
        "classifier.bias": sd["head.bias"],
    }
    D = model.cfg.hidden_size
    for i, blk in enumerate(model.blocks):
        assert isinstance(blk, Block)
        layer = f"vit.layers.{i}." if new else f"vit.encoder.layer.{i}."
        modules = {
            "norm1": blk.norm1,
            "norm2": blk.norm2,
            "proj": blk.attn.proj,
            "fc1": blk.mlp.fc1,
            "fc2": blk.mlp.fc2,
        }
        for ours, names in _BLOCK_NAMES.items():
            for p in ("weight", "bias"):
                out[layer + names[0 if new else 1] + "." + p] = getattr(modules[ours], p).detach()
        for j, name in enumerate(_QKV_NAMES[0 if new else 1]):  # split the fused (3D, D) qkv into q, k, v
            out[layer + name + ".weight"] = blk.attn.qkv.weight.detach()[j * D : (j + 1) * D]
            if blk.attn.qkv.bias is not None:
                out[layer + name + ".bias"] = blk.attn.qkv.bias.detach()[j * D : (j + 1) * D]
    return out


def to_transformers(model: VisionTransformer, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' ``ViTForImageClassification`` with ``model``'s weights, in eval mode, same device
    and dtype. ``forward(pixel_values).logits`` equals ``model(pixel_values)``."""
    from transformers import ViTForImageClassification

    ref = next(model.parameters())
    with torch.device("meta"):
        hf = ViTForImageClassification(transformers_config(model, attn_implementation))
    expected = set(hf.state_dict())
    sd = transformers_state_dict(model, "5" if "vit.layers.0.layernorm_before.weight" in expected else "4")
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ConfigError(f"transformers ViT layout not recognised: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True, assign=True)
    module: nn.Module = hf
    return module.to(device=ref.device, dtype=ref.dtype).eval()
