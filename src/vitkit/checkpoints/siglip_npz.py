"""big_vision SigLIP ``.npz`` image towers (``big_vision/models/vit.py`` with ``pool_type="map"``).

The two-tower checkpoints hold the image tower under ``params/img/`` (the text tower, ``params/txt/``, and the
temperature and bias ``params/t``, ``params/b`` are outside it and ignored); a bare image tower under ``params/``
or no prefix is read too. Names, beside big_vision's ViT (:mod:`vitkit.checkpoints.big_vision`)::

    embedding/{kernel,bias}   pos_embedding (1, N, D): patches only, no class token
    Transformer/encoderblock_{i}/... (or scan-stacked Transformer/encoderblock/...)   Transformer/encoder_norm
    MAPHead_0/probe (1, 1, D), MAPHead_0/MultiHeadDotProductAttention_0/{query,key,value,out},
    MAPHead_0/LayerNorm_0, MAPHead_0/MlpBlock_0/Dense_{0,1}     head/{kernel,bias} (the image embedding, optional)

The MAP head is vitkit's ``attn_pool`` (query <- probe; key and value fused as ``kv``). Options are read from
the shapes: width, depth, patch, grid, heads (the query kernel's (D, h, d)), MLP width, the head's size. The
rest is big_vision's code: tanh-GELU (``nn.gelu``'s default), LayerNorm eps 1e-6, no class token, and the MAP
head's MLP as wide as the blocks' (refused when ``MAPHead_0/MlpBlock_0`` says otherwise). This is the layout
timm's ``_load_weights`` reads for its ``vit_*_siglip_*`` models; the tests check vitkit against it.

Preprocessing: SigLIP's (squash to the model's size, bilinear, mean = std = 0.5, inputs in [-1, 1]).
Writing puts the tower under ``params/img/``, per-block (``scan=True`` in :func:`write`: stacked).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitkit.checkpoints import big_vision, npz_files
from vitkit.checkpoints.keymap import (
    Array,
    Rule,
    dense,
    from_state_dict,
    heads_in,
    heads_in_bias,
    heads_out,
    layernorm,
    rule,
    shape_reader,
    split_heads_in,
    split_heads_in_bias,
    split_heads_out,
)
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, convert, export_state, refusing, require
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "siglip"
MAP = "MAPHead_0"
MHA = f"{MAP}/MultiHeadDotProductAttention_0"
PREFIX = "params/img/"


def map_rules(num_heads: int) -> list[Rule]:
    """big_vision's MAPHead_0 <-> vitkit's attn_pool."""
    h = num_heads
    kv = [f"{MHA}/{n}/kernel" for n in ("key", "value")]
    kv_bias = [f"{MHA}/{n}/bias" for n in ("key", "value")]
    return [
        rule("attn_pool.probe", f"{MAP}/probe"),
        rule("attn_pool.q.weight", f"{MHA}/query/kernel", heads_in, split_heads_in(h, 1)),
        rule("attn_pool.q.bias", f"{MHA}/query/bias", heads_in_bias, split_heads_in_bias(h, 1)),
        rule("attn_pool.kv.weight", kv, heads_in, split_heads_in(h, 2)),
        rule("attn_pool.kv.bias", kv_bias, heads_in_bias, split_heads_in_bias(h, 2)),
        rule("attn_pool.proj.weight", f"{MHA}/out/kernel", heads_out, split_heads_out(h)),
        rule("attn_pool.proj.bias", f"{MHA}/out/bias"),
        *layernorm("attn_pool.norm", f"{MAP}/LayerNorm_0"),
        *dense("attn_pool.mlp.fc1", f"{MAP}/MlpBlock_0/Dense_0"),
        *dense("attn_pool.mlp.fc2", f"{MAP}/MlpBlock_0/Dense_1"),
    ]


def key_map(cfg: ViTConfig) -> list[Rule]:
    """big_vision names (blocks expanded, no prefix) for a SigLIP image tower with this config."""
    return big_vision.key_map(cfg) + map_rules(cfg.num_heads)


def looks_like(path: Path) -> bool:
    """A big_vision .npz whose image tower has a MAP head (``MAPHead_0/probe``)."""
    keys = npz_files.file_keys(path) or []
    return npz_files.layout(keys) == "big_vision" and f"{npz_files.find_prefix(keys)}{MAP}/probe" in keys


def infer_config(arrays: Mapping[str, Array], source: str) -> ViTConfig:
    """The architecture, from the shapes (module docstring)."""
    shape = shape_reader(arrays, "SigLIP image tower", source)
    kh, kw, C, D = shape("embedding/kernel")
    if kh != kw:
        raise CheckpointError(f"{source}: embedding/kernel: non-square patches {kh}x{kw}")
    if "cls" in arrays:
        raise CheckpointError(f"{source}: cls: a class token beside a MAP head is not big_vision's SigLIP")
    q = shape(f"{big_vision.ATTN.format(i=0)}/query/kernel")
    if len(q) != 3:
        raise CheckpointError(f"{source}: query kernel has shape {q}, expected (D, heads, head_dim)")
    mlp_dim = shape(f"{big_vision.BLOCK.format(i=0)}/MlpBlock_0/Dense_0/kernel")[1]
    head_mlp = shape(f"{MAP}/MlpBlock_0/Dense_0/kernel")[1]
    if head_mlp != mlp_dim:
        raise CheckpointError(
            f"{source}: {MAP}/MlpBlock_0/Dense_0/kernel is {head_mlp} wide and the blocks' MLP {mlp_dim}; vitkit's MAP "
            "head has the blocks' width"
        )
    map_heads = shape(f"{MHA}/query/kernel")
    if map_heads[1:2] != q[1:2]:
        raise CheckpointError(f"{source}: {MHA}/query/kernel has {map_heads} heads, the blocks {q[1]}")
    n = shape(big_vision.POS)[1]
    try:
        side = grid_side(n)
    except ValueError as e:
        raise CheckpointError(f"{source}: pos_embedding: {e}") from None
    depth = 1 + max(int(k.split("/")[1].split("_")[1]) for k in arrays if k.startswith("Transformer/encoderblock_"))
    with refusing(source):
        return ViTConfig(
            image_size=(side * kh, side * kh),
            patch_size=kh,
            in_channels=C,
            num_classes=shape("head/kernel")[1] if "head/kernel" in arrays else 0,
            hidden_size=D,
            depth=depth,
            num_heads=q[1],
            mlp_dim=mlp_dim,
            classifier="map",
            gelu="tanh",
            layer_norm_eps=1e-6,
            name=f"SigLIP {D}/{kh}",
        )


def load(path: Path) -> Checkpoint:
    """Read a big_vision SigLIP .npz (image tower; per-block or scan-stacked) into vitkit's layout, shape-checked."""
    arrays, prefix, outside = npz_files.strip_prefix(npz_files.read_npz(path), str(path))
    scan = any(k.startswith(big_vision.SCAN) for k in arrays)
    arrays = big_vision.unstack_scan(arrays, str(path))
    cfg = infer_config(arrays, str(path))
    state = convert(cfg, arrays, str(path), key_map)
    provenance: dict[str, Any] = {"layout": "big_vision SigLIP", "prefix": prefix, "scan": scan}
    if outside:
        provenance["ignored_keys"] = len(outside)  # the text tower, t and b
    return npz_files.checkpoint(FORMAT, path, cfg, state, provenance)


def check_writable(cfg: ViTConfig) -> None:
    target = "a big_vision SigLIP .npz"
    require(cfg.classifier == "map" and not cfg.class_token, target, "it holds a MAP head and no class token")
    require(cfg.gelu == "tanh" and cfg.layer_norm_eps == 1e-6, target, "big_vision's code is tanh-GELU, eps 1e-6")
    require(cfg.pos_embed == "learned" and cfg.rope is None, target, "it holds a learned position embedding")
    plain = cfg.mlp == "plain" and cfg.layer_scale is None and not cfg.norm_pre and cfg.num_registers == 0
    require(plain and not cfg.distilled, target, "big_vision's ViT has no SwiGLU, layer scale, pre-norm or registers")
    require(cfg.patch_bias and cfg.qkv_bias and cfg.key_bias, target, "its projections all have biases")
    require(not cfg.projection_size and not cfg.representation_size, target, "it has no projection or pre-logits")
    require(cfg.resnet_layers is None, target, "big_vision's SigLIP has no hybrid stem")


def write(
    model: VisionTransformer, path: str | Path, *, scan: bool = False, prefix: str = PREFIX, overwrite: bool = False
) -> Path:
    """Write ``model`` as a SigLIP image tower (``scan=True``: blocks stacked on a leading depth axis)."""
    check_writable(model.cfg)
    arrays = from_state_dict(key_map(model.cfg), export_state(model))
    if scan:
        arrays = big_vision.stack_scan(arrays, model.cfg.depth)
    return npz_files.write_npz({prefix + k: v for k, v in arrays.items()}, path, overwrite=overwrite)


def save(model: VisionTransformer, path: Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False) -> Path:
    """Registry entry point (the format holds no metadata)."""
    return write(model, path, overwrite=overwrite)
