"""big_vision ``.npz`` checkpoints (``big_vision/models/vit.py``): Linen module names, ``params/`` prefix.

    params/embedding/{kernel,bias}      params/cls (pool_type "tok" only)
    params/pos_embedding (1, N, D)      added to the patches BEFORE the class token is prepended
    params/Transformer/encoderblock_{i}/LayerNorm_0, MultiHeadDotProductAttention_0/{query,key,value,out},
                                        LayerNorm_1, MlpBlock_0/Dense_{0,1}
    params/Transformer/encoderblock/... the same, scan-stacked: a leading depth axis on every array
    params/Transformer/encoder_norm     params/pre_logits (optional)     params/head (optional)

Semantics mapped exactly onto vitkit's model:

- position embedding without a class slot: loaded as vitkit's (1, 1 + N, D) embedding with a zero class slot,
  which is the same function (the class token gets no position embedding). Older checkpoints keep the
  embedding at ``Transformer/pos_embedding`` or ``Transformer/posembed_input/pos_embedding``, possibly with the
  class slot (1 + N entries, the pre-2022 layout); all are read.
- no ``pos_embedding`` at all: fixed 2-D sin-cos (``posemb="sincos2d"``), which stores no grid: the image
  size is taken as 224 unless ``image_size=`` is given when loading.
- pool_type "tok" (``cls`` present) or "gap" (no ``cls``); "map" (``MAPHead_0``, SigLIP) is the ``siglip``
  format's (:mod:`vitkit.checkpoints.siglip_npz`), refused here. pool_type "0"
  (first patch token, no class token) cannot be told from "gap" by structure and is read as "gap".
- GELU is jax.nn.gelu's tanh approximation, LayerNorm eps 1e-6.

Writing: a nonzero class slot of the position embedding is folded into ``cls`` (big_vision's own rule for old
checkpoints); the class position then computes the same single float32 addition, so outputs are bit-identical.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import npz_files, official
from vitkit.checkpoints.keymap import (
    Array,
    Rule,
    conv_hwio,
    conv_oihw,
    dense,
    expand,
    flax_attention,
    from_state_dict,
    layernorm,
    rule,
    shape_reader,
)
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    is_square,
    refusing,
    require,
    require_unseen,
)
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "big_vision"
BLOCK = "Transformer/encoderblock_{i}"
ATTN = BLOCK + "/MultiHeadDotProductAttention_0"
SCAN = "Transformer/encoderblock/"
POS = "pos_embedding"
OLD_POS = ("Transformer/pos_embedding", "Transformer/posembed_input/pos_embedding")
DEFAULT_IMAGE = 224  # sin-cos checkpoints store no grid


def key_map(cfg: ViTConfig) -> list[Rule]:
    """big_vision names (blocks expanded, no prefix) for a model with this config."""
    h = cfg.num_heads
    rules: list[Rule] = [
        rule("patch_embed.proj.weight", "embedding/kernel", conv_hwio, conv_oihw),
        rule("patch_embed.proj.bias", "embedding/bias"),
        *layernorm("blocks.{i}.norm1", BLOCK + "/LayerNorm_0"),
        *flax_attention("blocks.{i}.attn", ATTN, h),
        *layernorm("blocks.{i}.norm2", BLOCK + "/LayerNorm_1"),
        *dense("blocks.{i}.mlp.fc1", BLOCK + "/MlpBlock_0/Dense_0"),
        *dense("blocks.{i}.mlp.fc2", BLOCK + "/MlpBlock_0/Dense_1"),
        *layernorm("norm", "Transformer/encoder_norm"),
    ]
    if cfg.classifier == "token":
        rules.append(rule("cls_token", "cls"))
    if cfg.pos_embed == "learned":
        rules.append(_posemb_rule(cfg))
    if cfg.representation_size:
        rules += dense("pre_logits.0", "pre_logits")
    if cfg.num_classes > 0:
        rules += dense("head", "head")
    return expand(rules, cfg.depth)


def _posemb_rule(cfg: ViTConfig) -> Rule:
    """(1, N, D) without a class slot <-> vitkit's (1, prefix + N, D); a stored class slot is kept as is."""
    n = cfg.grid_size[0] * cfg.grid_size[1]

    def load(pe: Array) -> Array:
        if cfg.classifier == "token" and pe.shape[1] == n:
            return np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
        return pe

    def save(pe: Array) -> tuple[Array]:
        return (pe[:, cfg.num_prefix_tokens :],)  # the class slot was folded into cls before (see save)

    return rule("pos_embed", POS, load, save)


def looks_like(path: Path) -> bool:
    return npz_files.file_layout(path) == FORMAT


def unstack_scan(arrays: Mapping[str, Array], source: str) -> dict[str, Array]:
    """Scan-stacked ``Transformer/encoderblock/...`` (depth, ...) -> per-block ``encoderblock_{i}/...``."""
    stacked = {k: v for k, v in arrays.items() if k.startswith(SCAN)}
    if not stacked:
        return dict(arrays)
    depths = {int(v.shape[0]) if v.ndim else 0 for v in stacked.values()}
    if len(depths) != 1 or 0 in depths:
        raise CheckpointError(f"{source}: scan-stacked blocks disagree on the depth axis ({sorted(depths)})")
    if any(k.startswith("Transformer/encoderblock_") for k in arrays):
        raise CheckpointError(f"{source}: both scan-stacked and per-block encoder blocks present")
    out = {k: v for k, v in arrays.items() if not k.startswith(SCAN)}
    for k, v in stacked.items():
        rest = k[len(SCAN) :]
        for i in range(v.shape[0]):
            out[f"Transformer/encoderblock_{i}/{rest}"] = v[i]
    return out


def normalise(arrays: Mapping[str, Array], source: str) -> dict[str, Array]:
    """Unstack scan blocks and move an old-style position embedding to ``pos_embedding``."""
    if any(k.startswith("MAPHead_0/") or k == "probe" for k in arrays):
        raise CheckpointError(
            f"{source}: multihead attention pooling (pool_type='map', MAPHead_0) is not supported by vitkit's ViT"
        )
    out = unstack_scan(arrays, source)
    for old in OLD_POS:
        if old in out:
            if POS in out:
                raise CheckpointError(f"{source}: position embedding stored twice ({POS} and {old})")
            out[POS] = out.pop(old)
    return out


def infer_config(arrays: Mapping[str, Array], source: str, image_size: int = DEFAULT_IMAGE) -> ViTConfig:
    """The architecture, from the arrays' shapes."""
    shape = shape_reader(arrays, "big_vision ViT checkpoint", source)
    emb = shape("embedding/kernel")
    q = shape(f"{ATTN.format(i=0)}/query/kernel")
    fc1 = shape(f"{BLOCK.format(i=0)}/MlpBlock_0/Dense_0/kernel")
    if len(emb) != 4 or emb[0] != emb[1]:
        raise CheckpointError(f"{source}: patch embedding {emb} is not a square conv kernel")
    depth = 1 + max(int(m.group(1)) for k in arrays if (m := re.match(r"Transformer/encoderblock_(\d+)/", k)))
    patch, width = emb[0], emb[3]
    token = "cls" in arrays
    if POS in arrays:
        n = int(arrays[POS].shape[1])
        side = grid_side(n - 1) if token and is_square(n - 1) and not is_square(n) else grid_side(n)
        size = side * patch
    else:
        size = image_size
    return ViTConfig(
        image_size=(size, size),
        patch_size=patch,
        in_channels=emb[2],
        num_classes=int(arrays["head/kernel"].shape[1]) if "head/kernel" in arrays else 0,
        hidden_size=width,
        depth=depth,
        num_heads=q[1],
        mlp_dim=fc1[1],
        classifier="token" if token else "gap",
        pos_embed="learned" if POS in arrays else "sincos2d",
        representation_size=int(arrays["pre_logits/kernel"].shape[1]) if "pre_logits/kernel" in arrays else None,
        gelu="tanh",
        layer_norm_eps=1e-6,
    )


def load(path: Path) -> Checkpoint:
    """Read a big_vision .npz (any prefix, per-block or scan-stacked) into vitkit's layout, shape-checked."""
    arrays, prefix, outside = npz_files.strip_prefix(npz_files.read_npz(path), str(path))
    scan = any(k.startswith(SCAN) for k in arrays)
    arrays = normalise(arrays, str(path))
    with refusing(str(path)):  # a position grid that is not square, a value ViTConfig refuses
        cfg = infer_config(arrays, str(path))
    state = convert(cfg, arrays, str(path), key_map)
    provenance: dict[str, Any] = {"layout": "big_vision", "prefix": prefix, "scan": scan}
    if outside:
        provenance["ignored_keys"] = len(outside)
    if cfg.pos_embed == "sincos2d":
        provenance["note"] = f"sin-cos position embedding: no stored grid, image size assumed {DEFAULT_IMAGE}"
    return npz_files.checkpoint(FORMAT, path, cfg, state, provenance)


def write(
    model: VisionTransformer, path: str | Path, *, scan: bool = False, prefix: str = "params/", overwrite: bool = False
) -> Path:
    """Write ``model`` as a big_vision checkpoint (``scan=True``: blocks stacked on a leading depth axis)."""
    cfg = model.cfg
    require(cfg.resnet_layers is None, "big_vision .npz", "big_vision's ViT has no hybrid ResNet stem")
    require_unseen(cfg, "big_vision .npz")
    state = export_state(model)
    if cfg.classifier == "token" and cfg.pos_embed == "learned":
        pe = state["pos_embed"]
        state["cls_token"] = state["cls_token"] + pe[:, :1]  # exactly what the class position computes
        state["pos_embed"] = torch.cat([torch.zeros_like(pe[:, :1]), pe[:, 1:]], dim=1)
    arrays = from_state_dict(key_map(cfg), state)
    if scan:
        arrays = stack_scan(arrays, cfg.depth)
    return npz_files.write_npz({prefix + k: v for k, v in arrays.items()}, path, overwrite=overwrite)


def stack_scan(arrays: Mapping[str, Array], depth: int) -> dict[str, Array]:
    """Per-block arrays -> scan-stacked ``Transformer/encoderblock/...`` with a leading depth axis."""
    first = "Transformer/encoderblock_0/"
    out = {k: v for k, v in arrays.items() if not k.startswith("Transformer/encoderblock_")}
    for k in (k for k in arrays if k.startswith(first)):
        rest = k[len(first) :]
        out[SCAN + rest] = np.stack([arrays[f"Transformer/encoderblock_{i}/{rest}"] for i in range(depth)])
    return out


def save(model: VisionTransformer, path: Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False) -> Path:
    """Registry entry point (the format holds no metadata); exact-GELU models are refused as for ``official``."""
    official.require_tanh_gelu(model.cfg, "big_vision .npz")
    return write(model, path, overwrite=overwrite)
