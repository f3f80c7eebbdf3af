"""timm's EVA-02 (``timm/models/eva.py``: ``eva02_{tiny,small,base,large}_patch14_{224,336,448}``, the MIM
pre-trained and ImageNet fine-tuned towers, and ``eva02_base_patch16_clip_224``, ``eva02_large_patch14_clip_{224,336}``,
EVA-CLIP's image towers): timm's ``Eva`` with a learned position embedding beside RoPE. Read and written, in the
``timm_eva`` format (:func:`load` and :func:`save` hand timm's DINOv3 models to :mod:`vitkit.checkpoints.timm_eva`).

Names (timm's Eva -> vitkit)::

    cls_token  pos_embed (1, 1 + N, D)  patch_embed.proj        (no registers)
    blocks.{i}.norm1, attn.qkv (3D, D) + attn.q_bias, attn.v_bias             (qkv_fused: tiny, small)
                      attn.q_proj.{weight,bias}, k_proj.weight, v_proj.{...}  (qkv_fused=False: base, large)
                      -> attn.qkv, q_bias, v_bias (no key bias: vitkit's key_bias=False)
    attn.norm (scale_attn_inner, EVA-CLIP: vitkit's attn_norm), attn.proj, norm2,
    mlp.fc1 (GluMlp, [gate; up]) or mlp.fc1_g / fc1_x (SwiGLU), mlp.norm (scale_mlp: sub-LN, vitkit's mlp_norm),
    mlp.fc2, gamma_1 / gamma_2 (layer scale, when init_values)
    norm (global_pool "token")  or  fc_norm (global_pool "avg": vitkit's classifier "gap" with fc_norm)   head

Semantics, from timm's ``Eva``, ``EvaAttention`` and ``RotaryEmbeddingCat`` (``rope_type='cat'``): pre-norm blocks,
LayerNorm eps 1e-6, the class token's slot in ``pos_embed`` (``no_embed_class=False``), which timm resamples
bicubically with antialiasing for other sizes (vitkit's ``pos_resample="bicubic"``); RoPE on the patch tokens with
index coordinates scaled to ``ref_feat_shape`` (16 x 16 in every entry point) and ``rope_temperature`` 10000
(vitkit's ``rope="eva"``, ``rope_ref_grid``, ``rope_theta``; :func:`vitkit.models.rope.eva_rope_tables`). timm
rotates interleaved channel pairs where vitkit rotates halves: the query and key rows of every head are reordered
evens first, then odds, as they are read (and back as they are written), so the model computes timm's function
with vitkit's kernels. The MLP is SwiGLU (``mlp_ratio`` 4 * 2 / 3, hidden ``int(D * mlp_ratio)``) with a LayerNorm
of the hidden before ``fc2`` in base and large; EVA-CLIP's towers add a LayerNorm of the merged heads before
``attn.proj`` (``scale_attn_inner``). What vitkit does not compute -- qk-norm, a pre-transformer norm, registers
beside a position table, post-norm blocks, grouped-query attention, the other RoPE kinds -- is refused in one line
naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import timm_eva, timm_format, timm_writer
from vitkit.checkpoints.keymap import Array, Rule, expand, from_state_dict, rule, weight_bias
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, convert, export_state, refusing, require
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

ENTRY = re.compile(r"^eva02_(tiny|small|base|large)_patch14_(224|336|448)$")
# EVA-CLIP's image towers (name -> size, patch, image size): base and large with a LayerNorm inside the attention
CLIP = {"eva02_base_patch16_clip_224": ("base", 16, 224), "eva02_large_patch14_clip_224": ("large", 14, 224),
        "eva02_large_patch14_clip_336": ("large", 14, 336)}  # fmt: skip
# each entry point's (width, depth, heads) and whether it has scale_mlp with separate q/k/v (timm 1.0.31 eva.py)
SHAPES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16)}
SIZES = {shape[0]: name for name, shape in SHAPES.items()}
TEMPERATURE = 10000.0  # timm's Eva default, every EVA-02 entry point's
REF_GRID = (16, 16)  # every EVA-02 entry point's ref_feat_shape (224 / 14)
EPS = 1e-6  # timm's LayerNorm default, Eva's norm_layer
# what timm's Eva holds that vitkit's ViT does not compute (key -> what it is)
REFUSED = {
    "blocks.0.attn.q_norm.weight": "qk-norm",
    "norm_pre.weight": "a LayerNorm before the blocks (use_pre_transformer_norm)",
    "reg_token": "register tokens beside a position table",
}
# model_args vitkit computes only at one value (name -> that value)
FIXED = {"rope_type": "cat", "rope_grid_offset": 0, "rope_grid_indexing": "ij", "use_rot_pos_emb": True,
         "use_post_norm": False, "use_pre_transformer_norm": False, "qk_norm": False,
         "attn_type": "eva", "num_kv_heads": None, "dynamic_img_pad": False, "num_reg_tokens": 0}  # fmt: skip


def claims(doc: Mapping[str, Any] | None) -> bool:
    """Whether timm's config describes an EVA-02 (an entry point, or an Eva with ``rope_type`` 'cat' and a position
    table beside it) rather than a DINOv3."""
    if not doc:
        return False
    arch = str(doc.get("architecture", ""))
    args = doc.get("model_args") or {}
    if ENTRY.match(arch) or arch in CLIP:
        return True
    return arch.startswith("eva") and isinstance(args, dict) and args.get("rope_type", "cat") == "cat"


def _arguments(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The model_args that rebuild the model: the entry point's, then the config's own, each checked."""
    arch = str(doc.get("architecture", ""))
    # timm.create_model drops the keyword arguments that are None: the entry point's own value applies
    args = {k: v for k, v in dict(doc.get("model_args") or {}).items() if v is not None}
    entry = ENTRY.match(arch)
    size, patch, image = CLIP.get(arch) or ((entry.group(1), 14, int(entry.group(2))) if entry else ("", 0, 0))
    base: dict[str, Any] = {"use_rot_pos_emb": True, "ref_feat_shape": None}
    if size:
        D, depth, heads = SHAPES[str(size)]
        big = size in ("base", "large")
        base = {"embed_dim": D, "depth": depth, "num_heads": heads, "img_size": image, "patch_size": patch,
                "use_rot_pos_emb": True, "ref_feat_shape": list(REF_GRID), "swiglu_mlp": True, "scale_mlp": big,
                "qkv_fused": not big, "scale_attn_inner": arch in CLIP}  # fmt: skip
        base.update({"global_pool": "token"} if arch in CLIP else {})
    args = {**base, **args}
    for key, want in FIXED.items():
        if key in args and args[key] != want and not (key == "rope_grid_offset" and args[key] == 0.0):
            raise CheckpointError(f"{source}: timm Eva with model_args.{key}={args[key]!r} is not supported ({want!r})")
    return args


def infer_config(
    weights: Mapping[str, torch.Tensor], doc: Mapping[str, Any], source: str
) -> tuple[ViTConfig, dict[str, Any], bool]:
    """(config, the model_args used, SwiGLU split into fc1_g/fc1_x) from the weights' shapes and timm's config."""
    for key, what in REFUSED.items():
        if key in weights:
            raise CheckpointError(f"{source}: timm Eva with {what} ({key}) is not supported by vitkit's ViT")
    args = _arguments(doc, source)
    D, C, P, P2 = (int(n) for n in weights["patch_embed.proj.weight"].shape)
    if P != P2:
        raise CheckpointError(f"{source}: non-square patches {P}x{P2} are not supported")
    depth = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    for key, found in (("embed_dim", D), ("depth", depth), ("patch_size", P)):
        if key in args and int(args[key]) != found:
            raise CheckpointError(f"{source}: {doc.get('architecture')} has {key} {args[key]}, the weights {found}")
    heads = args.get("num_heads") or timm_eva.HEADS.get(D)
    if not heads:
        raise CheckpointError(f"{source}: width {D} is not an EVA-02 entry point's; model_args.num_heads is needed")
    mlp, mlp_dim, split = timm_format._mlp(weights, source)
    swiglu = mlp == "swiglu"
    if bool(args.get("swiglu_mlp", swiglu)) != swiglu or args.get("act_layer") not in (None, "gelu"):
        raise CheckpointError(f"{source}: model_args.swiglu_mlp/act_layer do not describe the MLP in the weights "
                              f"({mlp}; vitkit reads SwiGLU and exact GELU)")  # fmt: skip
    fused = "blocks.0.attn.qkv.weight" in weights
    inner = "blocks.0.attn.norm.weight" in weights  # EVA-CLIP's LayerNorm of the merged heads
    if bool(args.get("scale_attn_inner", inner)) != inner:
        raise CheckpointError(f"{source}: model_args.scale_attn_inner={args.get('scale_attn_inner')!r}, but "
                              f"the weights {'have' if inner else 'lack'} blocks.0.attn.norm.weight")  # fmt: skip
    qkv_bias = "blocks.0.attn.q_bias" in weights or "blocks.0.attn.q_proj.bias" in weights
    pool = str(doc.get("global_pool") or args.get("global_pool") or "avg")
    if pool not in ("token", "avg"):
        raise CheckpointError(f"{source}: global_pool {pool!r} is not supported (token or avg)")
    fc_norm = "fc_norm.weight" in weights
    if fc_norm == ("norm.weight" in weights) or (fc_norm and pool != "avg"):
        raise CheckpointError(f"{source}: timm Eva with norm and fc_norm as they are here is not supported (one of "
                              "them: norm on the tokens, or fc_norm on the mean of the patch tokens)")  # fmt: skip
    ref = args.get("ref_feat_shape")
    size = args.get("img_size") or (doc.get("pretrained_cfg") or {}).get("input_size", [0, 224, 224])[1:]
    with refusing(source):
        cfg = ViTConfig(
            image_size=timm_eva._size(size, source),
            patch_size=P,
            in_channels=C,
            num_classes=int(weights["head.weight"].shape[0]) if "head.weight" in weights else 0,
            hidden_size=D,
            depth=depth,
            num_heads=int(heads),
            mlp_dim=mlp_dim,
            classifier="token" if pool == "token" else "gap",
            class_token=True if "cls_token" in weights else None,
            pos_embed="learned" if "pos_embed" in weights else "none",
            pos_embed_prefix=not args.get("no_embed_class", False),
            pos_resample="bicubic",
            layer_norm_eps=EPS,
            qkv_bias=qkv_bias,
            key_bias=not qkv_bias,
            layer_scale=float(args.get("init_values") or 1e-5) if "blocks.0.gamma_1" in weights else None,
            mlp=mlp,  # type: ignore[arg-type]
            mlp_norm="blocks.0.mlp.norm.weight" in weights,
            attn_norm=inner,
            fc_norm=fc_norm,
            rope="eva",
            rope_theta=float(args.get("rope_temperature", TEMPERATURE)),
            rope_ref_grid=None if ref is None else timm_eva._size(ref, source),
        )
    return cfg, {**args, "qkv_fused": fused}, split


# ---- the key map ----------------------------------------------------------------------------------


def _halves_order(num_heads: int, head_dim: int, interleaved: bool) -> np.ndarray:
    """Row order that turns timm's interleaved RoPE pairs (2m, 2m+1) of every head into vitkit's halves (m, m + d/2):
    evens first, then odds, head by head (the identity for timm's ``rope_rotate_half``)."""
    within = np.arange(head_dim)
    if interleaved:
        within = np.concatenate([within[0::2], within[1::2]])
    return (np.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def key_map(cfg: ViTConfig, fused: bool = True, split_swiglu: bool = False, interleaved: bool = True) -> list[Rule]:
    """timm Eva names for an EVA-02 with this config (blocks expanded): ``fused`` one qkv (else q/k/v_proj),
    ``split_swiglu`` SwiGLU's fc1_g/fc1_x, ``interleaved`` timm's default RoPE layout (see :func:`_halves_order`)."""
    D = cfg.hidden_size
    order = _halves_order(cfg.num_heads, cfg.head_dim, interleaved)
    back = np.argsort(order)
    rows = np.concatenate([order, D + order, 2 * D + np.arange(D)])  # q and k reordered, v as it is
    rules = weight_bias("patch_embed.proj", "patch_embed.proj", cfg.patch_bias)
    for name in ("norm1", "attn.proj", "norm2", "mlp.fc2"):
        rules += weight_bias(f"blocks.{{i}}.{name}", f"blocks.{{i}}.{name}")
    if fused:
        rules.append(rule("blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.qkv.weight",
                          lambda w: w[rows], lambda w: (w[np.argsort(rows)],)))  # fmt: skip
    else:
        names = [f"blocks.{{i}}.attn.{n}_proj.weight" for n in "qkv"]

        def load(q: Array, k: Array, v: Array) -> Array:
            return np.concatenate([q[order], k[order], v])

        def save(w: Array) -> tuple[Array, ...]:
            q, k, v = np.split(w, 3)
            return q[back], k[back], v

        rules.append(rule("blocks.{i}.attn.qkv.weight", names, load, save))
    if cfg.qkv_bias:
        q_bias = "blocks.{i}.attn.q_bias" if fused else "blocks.{i}.attn.q_proj.bias"
        rules.append(rule("blocks.{i}.attn.q_bias", q_bias, lambda b: b[order], lambda b: (b[back],)))
        v_bias = "blocks.{i}.attn.v_bias" if fused else "blocks.{i}.attn.v_proj.bias"
        rules.append(rule("blocks.{i}.attn.v_bias", v_bias))
    rules += timm_format._mlp_rules(cfg, split_swiglu)
    for name, present in (("mlp.norm", cfg.mlp_norm), ("attn.norm", cfg.attn_norm)):
        rules += weight_bias(f"blocks.{{i}}.{name}", f"blocks.{{i}}.{name}") if present else []
    if cfg.layer_scale is not None:
        rules += [rule(f"blocks.{{i}}.ls{n}.gamma", f"blocks.{{i}}.gamma_{n}") for n in (1, 2)]
    rules += weight_bias("norm", "fc_norm" if cfg.fc_norm else "norm")
    rules += [rule(t, t) for t in ("cls_token", "pos_embed") if (cfg.class_token if t == "cls_token" else
              cfg.pos_embed == "learned")]  # fmt: skip
    if cfg.num_classes > 0:
        rules += weight_bias("head", "head")
    return expand(rules, cfg.depth)


# ---- reading ------------------------------------------------------------------------------------------


def load(path: Path) -> Checkpoint:
    """Read a timm Eva state dict (file or hub folder): an EVA-02 here, a DINOv3 by :mod:`timm_eva`."""
    doc = timm_format._sidecar(path)
    if not claims(doc):
        return timm_eva.load(path)
    assert doc is not None
    weights = timm_format.read_weights(path, ".safetensors/.pth")
    cfg, args, split = infer_config(weights, doc, str(path))
    rules = lambda c: key_map(c, args["qkv_fused"], split, interleaved=not args.get("rope_rotate_half", False))  # noqa: E731
    # rope.* and attn.k_bias: buffers timm computes (and leaves out of its state dicts); ignored if saved
    state = convert(cfg, weights, str(path), rules, ignore=lambda k: k.startswith("rope.") or k.endswith("attn.k_bias"))
    provenance: dict[str, Any] = {"layout": "timm Eva (EVA-02)", "architecture": doc.get("architecture"),
                                  "qkv_fused": args["qkv_fused"]}  # fmt: skip
    return timm_format.checkpoint(path, cfg, state, doc, provenance, timm_eva.preprocess(doc, cfg), timm_eva.FORMAT)


# ---- writing ------------------------------------------------------------------------------------------


def check_representable(cfg: ViTConfig, target: str) -> None:
    """CheckpointError unless timm's Eva (EVA-02's settings) computes exactly this model."""
    require(cfg.rope == "eva" and cfg.pos_embed in ("learned", "none"), target, "EVA-02 has its RoPE and a learned "
            "position embedding or none")  # fmt: skip
    require(cfg.classifier in ("token", "gap"), target, "timm's Eva pools the class token or the patch mean")
    require(cfg.layer_norm_eps == EPS, target, f"timm's Eva builds LayerNorm eps {EPS}")
    require(cfg.mlp == "swiglu" or cfg.gelu == "exact", target, "timm's Eva MLP uses exact GELU")
    require(not (cfg.qkv_bias and cfg.key_bias), target, "timm's Eva has no key bias")
    require(cfg.layer_scale not in (0, 0.0), target, "timm builds no layer scale for init_values=0")
    extras = cfg.norm_pre or cfg.distilled or cfg.projection_size or cfg.representation_size or cfg.num_registers
    require(cfg.patch_bias and not extras, target, "timm's EVA-02: a patch bias, no pre-norm, registers or extra heads")
    require(cfg.resnet_layers is None, target, "timm's Eva has no hybrid stem")
    require(cfg.rope_ref_grid is not None, target, "timm.create_model drops a ref_feat_shape of None (the EVA-02 "
            "entry points' 16 x 16 would apply)")  # fmt: skip
    require(cfg.pos_embed == "none" or cfg.pos_resample == "bicubic", target, "timm resamples the position "
            f"embedding bicubically (with antialiasing); this model resamples {cfg.pos_resample!r}")  # fmt: skip


def timm_config(cfg: ViTConfig, meta: CheckpointMeta | None) -> dict[str, Any]:
    """timm's hub ``config.json``: the EVA-02 entry point of its width at 224 and model_args that override what
    differs (``timm.create_model(architecture, **model_args)`` rebuilds it). q/k/v are fused unless the MLP has its
    LayerNorm (as timm's own entry points lay them out)."""
    pre = meta.preprocess if meta else timm_eva._default_preprocess(cfg)
    pool = "token" if cfg.classifier == "token" else "avg"
    args: dict[str, Any] = {
        **timm_writer.shape_args(cfg),
        "qkv_bias": cfg.qkv_bias,
        "qkv_fused": not cfg.mlp_norm,
        "mlp_ratio": timm_writer.mlp_ratio(cfg.mlp_dim, cfg.hidden_size),
        "swiglu_mlp": cfg.mlp == "swiglu",
        "scale_mlp": cfg.mlp_norm,
        "scale_attn_inner": cfg.attn_norm,
        "init_values": cfg.layer_scale,
        "class_token": bool(cfg.class_token),
        "no_embed_class": not cfg.pos_embed_prefix,
        "use_abs_pos_emb": cfg.pos_embed == "learned",
        "use_rot_pos_emb": True,
        "rope_type": "cat",
        "rope_temperature": cfg.rope_theta,
        "ref_feat_shape": list(cfg.rope_ref_grid or ()),
        "use_fc_norm": cfg.fc_norm,
        "global_pool": pool,
        "num_classes": cfg.num_classes,
    }
    arch = f"eva02_{SIZES.get(cfg.hidden_size, 'base')}_patch14_224"
    return timm_writer.hub_config(cfg, arch, cfg.num_classes, pool, args, pre, meta)


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write ``model`` as timm's Eva: an EVA-02 here, a DINOv3 by :mod:`timm_eva`; a ``.safetensors`` file (timm's
    config in its metadata) or a hub folder (a bare ``.pth`` cannot carry the RoPE settings). Atomic; an existing
    file or vitkit-written folder is replaced only with ``overwrite``."""
    cfg = model.cfg
    if cfg.rope != "eva":
        return timm_eva.save(model, path, meta, overwrite=overwrite)
    out = Path(path)
    timm_writer.check_output(out, overwrite)
    check_representable(cfg, "a timm Eva (EVA-02) state dict")
    doc = timm_config(cfg, meta)
    rules = key_map(cfg, fused=doc["model_args"]["qkv_fused"], split_swiglu=cfg.mlp_norm)
    return timm_eva.write(out, lambda: from_state_dict(rules, export_state(model)), doc, overwrite)
