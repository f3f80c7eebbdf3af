"""Google's released ViT checkpoints (``ViT-B_16.npz``, AugReg ``*.npz``): the ``vit_jax`` layout.

Flat "/"-joined keys with pre-Linen module names::

    embedding/kernel (P, P, C, D)                  cls (1, 1, D)
    Transformer/posembed_input/pos_embedding (1, T, D)
    Transformer/encoderblock_{i}/LayerNorm_0, MultiHeadDotProductAttention_1/{query,key,value,out},
                                 LayerNorm_2, MlpBlock_3/Dense_{0,1}
    Transformer/encoder_norm     pre_logits/{kernel,bias} (optional)     head/{kernel,bias}

Hybrids (R50+ViT-B/16 ...) add the ResNet stem: ``conv_root/kernel``, ``gn_root/{scale,bias}``,
``block{n}/unit{m}/{conv1,conv2,conv3,conv_proj}/kernel`` and ``.../{gn1,gn2,gn3,gn_proj}/{scale,bias}``
(GroupNorm parameters stored (C,) or (1, 1, 1, C)); ``embedding`` is then the patch conv on the ResNet map.
Old training checkpoints keep the parameters under ``opt/target/``; the prefix is recognised and stripped.

The official code uses the tanh GELU, so models loaded from here use it too: the loaded model computes
the official function, not an approximation of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitkit.checkpoints import npz_files
from vitkit.checkpoints.keymap import (
    Array,
    Rule,
    conv_hwio,
    conv_oihw,
    dense,
    expand,
    flax_attention,
    from_state_dict,
    group_norm,
    layernorm,
    rule,
    shape_reader,
)
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    refusing,
    require,
    require_unseen,
    with_learned_posemb,
)
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.resnet import GN_GROUPS, resnet_reduction
from vitkit.models.vit import VisionTransformer, ViTConfig

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
        *flax_attention("blocks.{i}.attn", ATTN, h),
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
    return expand(rules, cfg.depth) + resnet_rules(cfg)


def resnet_rules(cfg: ViTConfig) -> list[Rule]:
    """The hybrid's ResNet stem (none for a plain ViT)."""
    if cfg.resnet_layers is None:
        return []
    ours = "patch_embed.resnet"
    rules = [
        rule(f"{ours}.conv_root.weight", "conv_root/kernel", conv_hwio, conv_oihw),
        *group_norm(f"{ours}.gn_root", "gn_root"),
    ]
    for n, depth in enumerate(cfg.resnet_layers, 1):
        for m in range(1, depth + 1):
            unit_ours, unit = f"{ours}.stages.block{n}.unit{m}", f"block{n}/unit{m}"
            convs = ["1", "2", "3"] + (["_proj"] if m == 1 else [])  # every stage's first unit projects
            for c in convs:
                rules.append(rule(f"{unit_ours}.conv{c}.weight", f"{unit}/conv{c}/kernel", conv_hwio, conv_oihw))
                rules += group_norm(f"{unit_ours}.gn{c}", f"{unit}/gn{c}")
    return rules


def infer_resnet(arrays: Mapping[str, Array], source: str) -> tuple[tuple[int, ...], float] | None:
    """(stage depths, width factor) of a hybrid's ResNet stem, or None for a plain ViT.

    The official root has ``int(64 * width_factor)`` channels for any factor, so the factor is width / 64
    (exact in binary floating point); the 32-group GroupNorm is what limits the width.
    """
    if "conv_root/kernel" not in arrays:
        return None
    width = int(arrays["conv_root/kernel"].shape[-1])
    if width < GN_GROUPS or width % GN_GROUPS:
        raise CheckpointError(
            f"{source}: ResNet root width {width} is not a positive multiple of {GN_GROUPS} (GroupNorm groups)"
        )
    layers: list[int] = []
    while any(k.startswith(f"block{len(layers) + 1}/unit1/") for k in arrays):
        n = len(layers) + 1
        layers.append(max(int(m.group(1)) for k in arrays if (m := re.match(rf"block{n}/unit(\d+)/", k))))
    factor = width / 64
    return tuple(layers), int(factor) if factor.is_integer() else factor


def infer_config(arrays: Mapping[str, Array], source: str) -> ViTConfig:
    """Read the architecture off the arrays' shapes (the checkpoint stores no config)."""
    shape = shape_reader(arrays, "official ViT checkpoint", source)
    emb = shape("embedding/kernel")
    q = shape(f"{ATTN.format(i=0)}/query/kernel")
    fc1 = shape(f"{BLOCK.format(i=0)}/MlpBlock_3/Dense_0/kernel")
    depth = 1 + max(int(m.group(1)) for k in arrays if (m := re.match(r"Transformer/encoderblock_(\d+)/", k)))
    if emb[0] != emb[1]:
        raise CheckpointError(f"{source}: non-square patches {emb[:2]} are not supported")
    patch, channels, width = emb[0], emb[2], emb[3]
    resnet = infer_resnet(arrays, source)
    stride = patch
    if resnet is not None:
        channels = int(arrays["conv_root/kernel"].shape[2])
        stride = patch * resnet_reduction(resnet[0])
    classifier = "token" if "cls" in arrays else "gap"
    prefix = 1 if classifier == "token" else 0
    pos_key = "Transformer/posembed_input/pos_embedding"
    if pos_key not in arrays:
        raise CheckpointError(f"{source}: missing {pos_key}")
    side = grid_side(arrays[pos_key].shape[1] - prefix)
    rep = int(arrays["pre_logits/kernel"].shape[1]) if "pre_logits/kernel" in arrays else None
    num_classes = int(arrays["head/kernel"].shape[1]) if "head/kernel" in arrays else 0
    return ViTConfig(
        image_size=(side * stride, side * stride),
        patch_size=patch,
        in_channels=channels,
        num_classes=num_classes,
        hidden_size=width,
        depth=depth,
        num_heads=q[1],
        mlp_dim=fc1[1],
        classifier=classifier,  # type: ignore[arg-type]
        representation_size=rep,
        gelu="tanh",
        layer_norm_eps=1e-6,
        resnet_layers=resnet[0] if resnet else None,
        resnet_width=resnet[1] if resnet else 1,
    )


read_npz = npz_files.read_npz


def load(path: Path) -> Checkpoint:
    """Read an official .npz into vitkit's layout, shape-checked, with the official preprocessing."""
    arrays, prefix, outside = npz_files.strip_prefix(read_npz(str(path)), str(path))
    with refusing(str(path)):  # a position grid that is not square, a value ViTConfig refuses
        cfg = infer_config(arrays, str(path))
    state = convert(cfg, arrays, str(path), key_map)
    provenance: dict[str, Any] = {"layout": "vit_jax (google-research/vision_transformer)"}
    if prefix:
        provenance.update(prefix=prefix, ignored_keys=len(outside))
    return npz_files.checkpoint("official", path, cfg, state, provenance)


def write(model_state: Mapping[str, Any], cfg: ViTConfig, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write a vitkit state dict in the official layout (loadable by ``vit_jax.checkpoint``).

    A sin-cos model is written with its table as the (learned-layout) position embedding: same function.
    The layout stores no image size, so the grid must be square to be read back.
    """
    require(cfg.grid_size[0] == cfg.grid_size[1], "official .npz", f"non-square token grid {cfg.grid_size}")
    require_unseen(cfg, "official .npz")
    cfg, state = with_learned_posemb(cfg, dict(model_state))
    return npz_files.write_npz(from_state_dict(key_map(cfg), state), path, overwrite=overwrite)


def save(model: VisionTransformer, path: Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False) -> Path:
    """Registry entry point: ``model`` as an official .npz (the format holds no metadata).

    The official code computes the tanh GELU, so an exact-GELU model is refused (it would read back as a
    different function, ~2e-4 relative); `write` writes the arrays regardless, for who accepts that.
    """
    require_tanh_gelu(model.cfg, "official .npz")
    return write(export_state(model), model.cfg, path, overwrite=overwrite)


def require_tanh_gelu(cfg: ViTConfig, target: str) -> None:
    require(
        cfg.gelu == "tanh",
        target,
        "Google's code computes the tanh GELU and this model uses the exact one (outputs would change by ~2e-4 "
        "relative); write it as vitkit, hf or timm",
    )
