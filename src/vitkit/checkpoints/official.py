"""Google's released ViT checkpoints (``ViT-B_16.npz``, AugReg ``*.npz``): the ``vit_jax`` layout.

Flat "/"-joined keys with pre-Linen module names::

    embedding/kernel (P, P, C, D)                  cls (1, 1, D)
    Transformer/posembed_input/pos_embedding (1, T, D)
    Transformer/encoderblock_{i}/LayerNorm_0, MultiHeadDotProductAttention_1/{query,key,value,out},
                                 LayerNorm_2, MlpBlock_3/Dense_{0,1}
    Transformer/encoder_norm     pre_logits/{kernel,bias} (optional)     head/{kernel,bias}

The official code uses the tanh GELU, so models loaded from here use it too: the loaded model computes
the official function, not an approximation of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.checkpoints.base import Checkpoint, CheckpointMeta, expected_state
from vitkit.checkpoints.keymap import (
    Array,
    Rule,
    conv_hwio,
    conv_oihw,
    dense,
    expand,
    from_state_dict,
    heads_in,
    heads_in_bias,
    heads_out,
    layernorm,
    rule,
    split_heads_in,
    split_heads_in_bias,
    split_heads_out,
    to_state_dict,
)
from vitkit.data.preprocess import INCEPTION_MEAN, INCEPTION_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import ViTConfig

BLOCK = "Transformer/encoderblock_{i}"
ATTN = BLOCK + "/MultiHeadDotProductAttention_1"


def key_map(cfg: ViTConfig) -> list[Rule]:
    """The official layout for a model with this config (blocks expanded)."""
    h = cfg.num_heads
    rules: list[Rule] = [
        rule("patch_embed.proj.weight", "embedding/kernel", conv_hwio, conv_oihw),
        rule("patch_embed.proj.bias", "embedding/bias"),
        rule("cls_token", "cls"),
        rule("pos_embed", "Transformer/posembed_input/pos_embedding"),
        *layernorm("blocks.{i}.norm1", BLOCK + "/LayerNorm_0"),
        rule(
            "blocks.{i}.attn.qkv.weight",
            [f"{ATTN}/{n}/kernel" for n in ("query", "key", "value")],
            heads_in,
            split_heads_in(h),
        ),
        rule(
            "blocks.{i}.attn.qkv.bias",
            [f"{ATTN}/{n}/bias" for n in ("query", "key", "value")],
            heads_in_bias,
            split_heads_in_bias(h),
        ),
        rule("blocks.{i}.attn.proj.weight", f"{ATTN}/out/kernel", heads_out, split_heads_out(h)),
        rule("blocks.{i}.attn.proj.bias", f"{ATTN}/out/bias"),
        *layernorm("blocks.{i}.norm2", BLOCK + "/LayerNorm_2"),
        *dense("blocks.{i}.mlp.fc1", BLOCK + "/MlpBlock_3/Dense_0"),
        *dense("blocks.{i}.mlp.fc2", BLOCK + "/MlpBlock_3/Dense_1"),
        *layernorm("norm", "Transformer/encoder_norm"),
    ]
    if cfg.classifier != "token":
        rules = [r for r in rules if r.ours != "cls_token"]
    if cfg.pos_embed != "learned":
        rules = [r for r in rules if r.ours != "pos_embed"]
    if cfg.representation_size:
        rules += dense("pre_logits.0", "pre_logits")
    if cfg.num_classes > 0:
        rules += dense("head", "head")
    return expand(rules, cfg.depth)


def looks_like(keys: Mapping[str, Any] | list[str]) -> bool:
    """True for the vit_jax layout (pre-Linen names, no ``params/`` prefix)."""
    ks = set(keys)
    return "embedding/kernel" in ks and any(k.startswith("Transformer/encoderblock_0/") for k in ks)


def infer_config(arrays: Mapping[str, Array], source: str) -> ViTConfig:
    """Read the architecture off the arrays' shapes (the checkpoint stores no config)."""
    try:
        emb = arrays["embedding/kernel"]
        q = arrays[f"{ATTN.format(i=0)}/query/kernel"]
        fc1 = arrays[f"{BLOCK.format(i=0)}/MlpBlock_3/Dense_0/kernel"]
    except KeyError as e:
        raise CheckpointError(f"{source}: not a complete official ViT checkpoint, missing {e.args[0]}") from None
    depth = 1 + max(int(m.group(1)) for k in arrays if (m := re.match(r"Transformer/encoderblock_(\d+)/", k)))
    if emb.shape[0] != emb.shape[1]:
        raise CheckpointError(f"{source}: non-square patches {emb.shape[:2]} are not supported")
    patch, channels, width = int(emb.shape[0]), int(emb.shape[2]), int(emb.shape[3])
    classifier = "token" if "cls" in arrays else "gap"
    prefix = 1 if classifier == "token" else 0
    pos_key = "Transformer/posembed_input/pos_embedding"
    if pos_key not in arrays:
        raise CheckpointError(f"{source}: missing {pos_key}")
    try:
        side = grid_side(arrays[pos_key].shape[1] - prefix)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    rep = int(arrays["pre_logits/kernel"].shape[1]) if "pre_logits/kernel" in arrays else None
    num_classes = int(arrays["head/kernel"].shape[1]) if "head/kernel" in arrays else 0
    return ViTConfig(
        image_size=(side * patch, side * patch),
        patch_size=patch,
        in_channels=channels,
        num_classes=num_classes,
        hidden_size=width,
        depth=depth,
        num_heads=int(q.shape[1]),
        mlp_dim=int(fc1.shape[1]),
        classifier=classifier,  # type: ignore[arg-type]
        representation_size=rep,
        gelu="tanh",
        layer_norm_eps=1e-6,
    )


def read_npz(path: str) -> dict[str, Array]:
    """All arrays of an .npz file, with a clear error for unreadable files."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable .npz checkpoint ({e})") from None


def load(path: Path) -> Checkpoint:
    """Read an official .npz into vitkit's layout, shape-checked, with the official preprocessing."""
    arrays = read_npz(str(path))
    cfg = infer_config(arrays, str(path))
    state = to_state_dict(key_map(cfg), arrays, expected_state(cfg), source=str(path))
    meta = CheckpointMeta(
        format="official",
        source=str(path),
        preprocess=Preprocess(image_size=cfg.image_size, mean=INCEPTION_MEAN, std=INCEPTION_STD),
        provenance={"layout": "vit_jax (google-research/vision_transformer)"},
    )
    return Checkpoint(cfg, state, meta)


def save(model_state: Mapping[str, Any], cfg: ViTConfig, path: str | Path) -> Path:
    """Write a vitkit state dict in the official layout (loadable by ``vit_jax.checkpoint``)."""
    arrays = from_state_dict(key_map(cfg), model_state)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    return out
