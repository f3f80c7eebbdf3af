"""OpenAI CLIP / OpenCLIP state dicts: the image tower (``visual.*``) of a whole CLIP model's state dict.

Names (``open_clip/transformer.py`` ``VisionTransformer``, OpenAI's ``clip/model.py``, the same)::

    visual.conv1.weight (D, C, P, P: no bias)   visual.class_embedding (D,)   visual.positional_embedding (1 + N, D)
    visual.ln_pre   visual.transformer.resblocks.{i}.{ln_1, attn.in_proj_weight/bias (3D, D), attn.out_proj,
    [ls_1.gamma], ln_2, mlp.c_fc, mlp.c_proj, [ls_2.gamma]}   visual.ln_post   visual.proj (D, E: bias-free)

Every key outside ``visual.`` (the text tower, ``logit_scale``) is ignored; any other ``visual.`` key (CoCa's
attentional pool, ``ln_attn``/``ln_inner``, a timm ``visual.trunk``) is refused, naming it. The shapes give
width, depth, patch, grid, MLP width, layer scale (OpenCLIP's ``ls_init_value``) and the projection; the class
token is pooled after ``ln_post`` (vitkit's final norm), then projected. LayerNorm eps is 1e-5 (torch's
default, which both codes use). The number of heads is ``width / head_width`` with open_clip's default
``head_width`` 64 (OpenAI's released models all have it), unless ``open_clip_config.json`` says otherwise.

The activation is not in the weights: OpenAI's models use QuickGELU (x sigmoid(1.702 x)), most OpenCLIP
models trained since exact GELU, and the same shapes load either way, silently computing different features.
So it is decided, in this order, by ``gelu=`` given to :func:`load`; an ``open_clip_config.json`` beside the
file (``model_cfg.quick_gelu``; absent: false, open_clip's default); the file's name, where open_clip's names
say it (``...-quickgelu...``: QuickGELU; ``openai``, open_clip's pretrained tag for OpenAI's weights, which it
loads with QuickGELU). When none says, the checkpoint is refused as ambiguous. OpenAI's own ``.pt`` files are
TorchScript archives, which a weights-only load refuses: save their ``state_dict()`` first.

This is the layout timm's ``checkpoint_filter_fn`` (``_convert_openai_clip``) converts for its
``vit_*_clip_*[_quickgelu]`` models; the tests check vitkit against it. Preprocessing: OpenAI's (bicubic
resize of the shorter side to the model's size, centre crop, OpenAI's mean/std). Read only: write CLIP towers
as timm or Hugging Face checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.keymap import Rule, expand, rule, shape_reader, weight_bias
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, convert, refusing
from vitkit.checkpoints.preprocess import CLIP_MEAN, CLIP_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import ViTConfig

FORMAT = "openclip"
SUFFIXES = (".safetensors", *torch_files.PICKLE_SUFFIXES)
CONFIG = "open_clip_config.json"
V = "visual."
BLOCK = V + "transformer.resblocks.{i}."
# open_clip vision_cfg fields vitkit represents (read and checked), and those it can only take at their default
VISION_FIELDS = ("width", "layers", "head_width", "patch_size", "image_size", "mlp_ratio", "ls_init_value")
VISION_DEFAULTS: dict[str, Any] = {
    "attentional_pool": False, "no_ln_pre": False, "pool_type": "tok", "final_ln_after_pool": False,
    "output_tokens": False, "timm_model_name": None, "act_kwargs": None, "norm_kwargs": None,
}  # fmt: skip
# fields that do not change the inference function (training-time, or only read with an option refused above)
VISION_IGNORED = ("patch_dropout", "output_dim", "attn_pooler_queries", "attn_pooler_heads", "timm_pool", "timm_proj")


def key_map(cfg: ViTConfig) -> list[Rule]:
    """OpenAI/OpenCLIP names for a CLIP image tower with this config (blocks expanded)."""
    rules = [
        rule("patch_embed.proj.weight", V + "conv1.weight"),
        rule("cls_token", V + "class_embedding", lambda a: a.reshape(1, 1, -1), lambda a: (a.reshape(-1),)),
        rule("pos_embed", V + "positional_embedding", lambda a: a[None], lambda a: (a[0],)),
        *weight_bias("norm_pre", V + "ln_pre"),
        *weight_bias("blocks.{i}.norm1", BLOCK + "ln_1"),
        rule("blocks.{i}.attn.qkv.weight", BLOCK + "attn.in_proj_weight"),
        rule("blocks.{i}.attn.qkv.bias", BLOCK + "attn.in_proj_bias"),
        *weight_bias("blocks.{i}.attn.proj", BLOCK + "attn.out_proj"),
        *weight_bias("blocks.{i}.norm2", BLOCK + "ln_2"),
        *weight_bias("blocks.{i}.mlp.fc1", BLOCK + "mlp.c_fc"),
        *weight_bias("blocks.{i}.mlp.fc2", BLOCK + "mlp.c_proj"),
        *weight_bias("norm", V + "ln_post"),
    ]
    if cfg.layer_scale is not None:
        rules += [rule(f"blocks.{{i}}.ls{n}.gamma", BLOCK + f"ls_{n}.gamma") for n in (1, 2)]
    if cfg.projection_size:
        rules.append(rule("projection.weight", V + "proj", lambda a: np.ascontiguousarray(a.T), lambda w: (w.T,)))
    return expand(rules, cfg.depth)


def looks_like(path: Path) -> bool:
    """A CLIP state dict with an OpenAI-layout image tower: ``visual.conv1.weight`` and ``visual.class_embedding``."""
    if not (path.is_file() and path.suffix in SUFFIXES):
        return False
    keys = torch_files.readable_keys(path)
    return V + "conv1.weight" in keys and V + "class_embedding" in keys


def open_clip_config(path: Path) -> dict[str, Any] | None:
    """``open_clip_config.json`` beside the weights (the HF hub's OpenCLIP repos ship it), or None."""
    doc_path = path.with_name(CONFIG)
    if not doc_path.is_file():
        return None
    try:
        doc = json.loads(doc_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{doc_path}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_cfg", {}), dict):
        raise CheckpointError(f"{doc_path}: expected an object with model_cfg")
    return doc


def activation(path: Path, doc: Mapping[str, Any] | None, gelu: str | None) -> tuple[str, str]:
    """(vitkit's gelu, what decided it): module docstring."""
    if gelu is not None:
        if gelu not in ("exact", "quick", "tanh"):
            raise CheckpointError(f"{path}: gelu {gelu!r} is none of exact, quick, tanh")
        return gelu, "gelu= given"
    if doc is not None:
        quick = (doc.get("model_cfg") or {}).get("quick_gelu", False)
        if not isinstance(quick, bool):
            raise CheckpointError(f"{path.with_name(CONFIG)}: model_cfg.quick_gelu {quick!r} is not true or false")
        return ("quick" if quick else "exact"), f"{CONFIG} model_cfg.quick_gelu={str(quick).lower()}"
    name = path.name.lower()
    if "quickgelu" in name or "openai" in name:
        return "quick", f"file name {path.name!r} (open_clip's quickgelu / openai naming)"
    raise CheckpointError(
        f"{path}: QuickGELU (OpenAI's weights) or exact GELU (most OpenCLIP weights) cannot be told from the "
        f"weights; put the model's {CONFIG} beside it, or pass gelu='quick' or 'exact' to openclip.load"
    )


def _vision_cfg(doc: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """open_clip's ``model_cfg.vision_cfg``: every field vitkit cannot compute refused, naming it."""
    v = dict(((doc or {}).get("model_cfg") or {}).get("vision_cfg") or {})
    for key, value in v.items():
        if key in VISION_FIELDS or key in VISION_IGNORED or (key in VISION_DEFAULTS and value == VISION_DEFAULTS[key]):
            continue
        raise CheckpointError(f"{source}: {CONFIG} vision_cfg.{key}={value!r} is not supported by vitkit's ViT")
    return v


def infer_config(weights: Mapping[str, torch.Tensor], vision: Mapping[str, Any], gelu: str, source: str) -> ViTConfig:
    """The architecture, from the shapes (and open_clip's vision_cfg where present, checked against them)."""
    for k in weights:
        if k.startswith(V + "trunk."):
            raise CheckpointError(f"{source}: {k}: an OpenCLIP tower with a timm trunk is not this layout")
    shape = shape_reader(weights, "CLIP image tower", source)
    D, C, P, P2 = shape(V + "conv1.weight")
    if P != P2:
        raise CheckpointError(f"{source}: visual.conv1.weight: non-square patches {P}x{P2}")
    pe = shape(V + "positional_embedding")
    if len(pe) != 2 or pe[1] != D:
        raise CheckpointError(f"{source}: visual.positional_embedding has shape {pe}, expected (1 + N, {D})")
    try:
        side = grid_side(pe[0] - 1)
    except ValueError:
        raise CheckpointError(
            f"{source}: visual.positional_embedding: {pe[0]} entries are not a class slot plus a square grid"
        ) from None
    depth = 1 + max(
        (int(k[len(V + "transformer.resblocks.") :].split(".")[0]) for k in weights if k.startswith(BLOCK[:-4])),
        default=-1,
    )
    if depth == 0:
        raise CheckpointError(f"{source}: not a complete CLIP image tower, missing {BLOCK.format(i=0)}*")
    head_width = int(vision.get("head_width", 64))
    if D % head_width:
        raise CheckpointError(f"{source}: width {D} is not a multiple of head_width {head_width}")
    for key, have in (("width", D), ("layers", depth), ("patch_size", P), ("image_size", side * P)):
        if key in vision and vision[key] != have:
            raise CheckpointError(f"{source}: {CONFIG} vision_cfg.{key}={vision[key]!r}, the weights say {have}")
    scaled = BLOCK.format(i=0) + "ls_1.gamma" in weights
    proj = shape(V + "proj")[1] if V + "proj" in weights else None
    with refusing(source):
        return ViTConfig(
            image_size=(side * P, side * P),
            patch_size=P,
            in_channels=C,
            num_classes=0,
            hidden_size=D,
            depth=depth,
            num_heads=D // head_width,
            mlp_dim=shape(BLOCK.format(i=0) + "mlp.c_fc.weight")[0],
            gelu=gelu,  # type: ignore[arg-type]
            layer_norm_eps=1e-5,
            layer_scale=float(vision.get("ls_init_value") or 1e-5) if scaled else None,
            norm_pre=True,
            patch_bias=False,
            projection_size=proj,
            pos_resample="bicubic",
            name=f"CLIP {D}/{P}",
        )


def load(path: Path, *, gelu: str | None = None) -> Checkpoint:
    """Read the image tower of an OpenAI/OpenCLIP state dict into vitkit's layout, shape-checked."""
    if not (path.is_file() and path.suffix in SUFFIXES):
        raise CheckpointError(f"{path}: expected a {'/'.join(SUFFIXES)} file holding a CLIP state dict")
    doc = open_clip_config(path)
    weights = {k: v for k, v in torch_files.read_state_file(path).items() if k.startswith(V)}
    act, why = activation(path, doc, gelu)
    cfg = infer_config(weights, _vision_cfg(doc, str(path)), act, str(path))
    state = convert(cfg, weights, str(path), key_map)
    pc = dict((doc or {}).get("preprocess_cfg") or {})
    with refusing(f"{path.with_name(CONFIG)}: preprocess_cfg"):
        pre = Preprocess(
            image_size=cfg.image_size,
            mean=tuple(pc.get("mean", CLIP_MEAN)),
            std=tuple(pc.get("std", CLIP_STD)),
            resize="shortest",
            interpolation=str(pc.get("interpolation", "bicubic")),
        )
    meta = CheckpointMeta(
        format=FORMAT,
        source=str(path),
        preprocess=pre,
        provenance={"layout": "OpenAI CLIP / OpenCLIP (visual.*)", "gelu": f"{act} ({why})"},
    )
    return Checkpoint(cfg, state, meta)
