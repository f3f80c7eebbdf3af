"""Hugging Face ``transformers`` CLIP and SigLIP image towers (``save_pretrained`` folders), both ways.

``model_type`` (config.json) picks the family; :mod:`vitkit.checkpoints.hf` dispatches here:

- ``clip_vision_model``: ``CLIPVisionModel`` (vitkit: ``num_classes=0``, forward = HF's ``pooler_output``) or
  ``CLIPVisionModelWithProjection`` (``visual_projection`` -> ``projection_size``, forward = ``image_embeds``):
  ``pre_layrnorm`` -> ``norm_pre``, a bias-free patch embedding, a class token with a position slot, QuickGELU.
  HF's ``post_layernorm`` normalises the pooled class token only; LayerNorm is per token, so it is vitkit's
  final norm followed by class-token pooling: the same function.
- ``siglip_vision_model``: ``SiglipVisionModel`` (``vision_use_head`` true): no class token, ``post_layernorm`` on
  every token, then the MAP head ``head`` (probe, ``nn.MultiheadAttention``, layernorm, mlp) -> ``classifier="map"``
  (forward = ``pooler_output``).
- ``clip`` / ``siglip``: a full ``CLIPModel`` / ``SiglipModel`` folder; only the vision tower (and CLIP's
  ``visual_projection``) is loaded, the text tower is ignored (and said so in the provenance).

Every option comes from the config (transformers' own defaults where a field is absent) or the weights' shapes
(the projection); fields whose values vitkit cannot compute are refused, naming the field.
``preprocessor_config.json``: ``CLIPImageProcessor`` (shortest edge + centre crop, truncated as transformers
does: the ``"shortest"`` resize mode) and ``SiglipImageProcessor`` (straight resize).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.checkpoints import hf, torch_files
from vitkit.checkpoints.hf import GELU, PREPROCESSOR, RESAMPLE, Family, _read_json
from vitkit.checkpoints.keymap import Rule, expand, from_state_dict, rule, stacked, weight_bias
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    refusing,
    require,
    with_learned_posemb,
)
from vitkit.checkpoints.preprocess import CLIP_MEAN, CLIP_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

ACT = {**GELU, "quick_gelu": "quick"}
ACT_NAME = {"exact": "gelu", "tanh": "gelu_pytorch_tanh", "quick": "quick_gelu"}
# transformers' CLIPVisionConfig / SiglipVisionConfig defaults, for fields a config.json leaves out
DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {"patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip": {"patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
COMMON = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "num_channels": 3, "image_size": 224, "attention_dropout": 0.0}  # fmt: skip
# model_type -> (family, full model with a text tower)
MODEL_TYPES = {
    "clip_vision_model": ("clip", False),
    "clip": ("clip", True),
    "siglip_vision_model": ("siglip", False),
    "siglip": ("siglip", True),
}
TEXT_KEYS = ("text_model.", "text_projection.", "logit_scale", "logit_bias")
IN_PROJ = "head.attention.in_proj_{}"  # the MAP head's fused q, k, v (3D rows)


def key_map(cfg: ViTConfig, family: str, prefix: str) -> list[Rule]:
    """transformers' names for a CLIP (``family="clip"``) or SigLIP vision tower under ``prefix``."""
    e, layer = f"{prefix}embeddings.", f"{prefix}encoder.layers.{{i}}."
    attn = f"{layer}self_attn."
    rules: list[Rule] = [
        rule("pos_embed", f"{e}position_embedding.weight", lambda a: a[None], lambda a: (a[0],)),
        *weight_bias("patch_embed.proj", f"{e}patch_embedding", bias=cfg.patch_bias),
        *weight_bias("blocks.{i}.norm1", f"{layer}layer_norm1"),
        stacked("blocks.{i}.attn.qkv.weight", [f"{attn}{n}_proj.weight" for n in "qkv"]),
        stacked("blocks.{i}.attn.qkv.bias", [f"{attn}{n}_proj.bias" for n in "qkv"]),
        *weight_bias("blocks.{i}.attn.proj", f"{attn}out_proj"),
        *weight_bias("blocks.{i}.norm2", f"{layer}layer_norm2"),
        *weight_bias("blocks.{i}.mlp.fc1", f"{layer}mlp.fc1"),
        *weight_bias("blocks.{i}.mlp.fc2", f"{layer}mlp.fc2"),
        *weight_bias("norm", f"{prefix}post_layernorm"),
    ]
    if family == "clip":
        rules.append(rule("cls_token", f"{e}class_embedding", lambda a: a[None, None], lambda a: (a[0, 0],)))
        rules += weight_bias("norm_pre", f"{prefix}pre_layrnorm")
        if cfg.projection_size:
            rules += weight_bias("projection", "visual_projection", bias=False)
    else:
        h = f"{prefix}head."
        rules += [
            rule("attn_pool.probe", f"{h}probe"),
            *(
                rule(f"attn_pool.{part}.{kind}", f"{prefix}{IN_PROJ.format(kind)}[{part}]")
                for part in ("q", "kv")
                for kind in ("weight", "bias")
            ),
            *weight_bias("attn_pool.proj", f"{h}attention.out_proj"),
            *weight_bias("attn_pool.norm", f"{h}layernorm"),
            *weight_bias("attn_pool.mlp.fc1", f"{h}mlp.fc1"),
            *weight_bias("attn_pool.mlp.fc2", f"{h}mlp.fc2"),
        ]
    return expand(rules, cfg.depth)


def split_in_proj(arrays: dict[str, Any], prefix: str) -> None:
    """The MAP head's in_proj_{weight,bias} (3D rows) -> its ``[q]`` (first D rows) and ``[kv]`` halves, in place."""
    for kind in ("weight", "bias"):
        key = f"{prefix}{IN_PROJ.format(kind)}"
        if key in arrays:
            a = arrays.pop(key)
            d = a.shape[0] // 3
            arrays[f"{key}[q]"], arrays[f"{key}[kv]"] = a[:d], a[d:]


def join_in_proj(arrays: dict[str, np.ndarray], prefix: str) -> None:
    """The inverse of :func:`split_in_proj`."""
    for kind in ("weight", "bias"):
        key = f"{prefix}{IN_PROJ.format(kind)}"
        if f"{key}[q]" in arrays:
            arrays[key] = np.concatenate([arrays.pop(f"{key}[q]"), arrays.pop(f"{key}[kv]")], axis=0)


# ---- config.json ----------------------------------------------------------------------------------


def vision_doc(doc: Mapping[str, Any], source: str) -> tuple[str, bool, dict[str, Any]]:
    """(family, whether the folder holds a full text+vision model, the vision tower's config fields; for CLIP
    ``projection_dim`` is the image projection's width, or None when the model has none)."""
    family, full = MODEL_TYPES[str(doc.get("model_type"))]
    vision = doc.get("vision_config", {}) if full else doc
    if not isinstance(vision, dict):
        raise CheckpointError(f"{source}: vision_config must be a JSON object, got {type(vision).__name__}")
    v = {**COMMON, **DEFAULTS[family], **vision}
    with_projection = full or "CLIPVisionModelWithProjection" in (doc.get("architectures") or [])
    v["projection_dim"] = (doc if full else v).get("projection_dim", 512) if with_projection else None
    return family, full, v


def _field(v: Mapping[str, Any], name: str, source: str) -> int:
    value = v[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{source}: {name} must be an integer, got {value!r}")
    return value


def config_from_hf(family: str, v: Mapping[str, Any], source: str) -> ViTConfig:
    """vitkit's config from a CLIP/SigLIP vision config (:func:`vision_doc`)."""
    gelu = hf.gelu_of(v, source, ACT)
    if family == "siglip" and not v.get("vision_use_head", True):
        raise CheckpointError(f"{source}: vision_use_head false (a SigLIP tower without its MAP head) is not supported")
    clip = family == "clip"
    try:
        return ViTConfig(
            image_size=(_field(v, "image_size", source),) * 2,
            patch_size=_field(v, "patch_size", source),
            in_channels=_field(v, "num_channels", source),
            num_classes=0,
            hidden_size=_field(v, "hidden_size", source),
            depth=_field(v, "num_hidden_layers", source),
            num_heads=_field(v, "num_attention_heads", source),
            mlp_dim=_field(v, "intermediate_size", source),
            classifier="token" if clip else "map",
            class_token=clip,
            norm_pre=clip,
            patch_bias=not clip,
            projection_size=_field(v, "projection_dim", source) if clip and v["projection_dim"] is not None else None,
            gelu=gelu,  # type: ignore[arg-type]
            layer_norm_eps=float(v["layer_norm_eps"]),
            attention_dropout=float(v["attention_dropout"]),
            pos_resample="bicubic_plain",  # transformers' interpolate_pos_encoding
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


# ---- preprocessor_config.json ---------------------------------------------------------------------


def _side(value: Any, keys: tuple[str, ...], what: str, source: str) -> tuple[int, ...]:
    """An HF size (an int, or a dict with ``keys``) as integers; anything else names the field."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * len(keys)
    if isinstance(value, dict) and all(isinstance(value.get(k), int) for k in keys):
        return tuple(int(value[k]) for k in keys)
    raise CheckpointError(f"{source}: {what} {value!r} is not supported (expected {' and '.join(keys)})")


def preprocess_from(folder: Path, family: str, image_size: tuple[int, int]) -> Preprocess:
    """CLIPImageProcessor (shortest edge, centre crop) or SiglipImageProcessor (straight resize) as a Preprocess;
    the processor's defaults at the model's size when the folder has no preprocessor_config.json."""
    path = folder / PREPROCESSOR
    doc = _read_json(path) if path.is_file() else {}
    src = str(path)
    if doc:  # the processor's own defaults (224) for the fields its file leaves out
        image_size = (224, 224)
    clip = family == "clip"
    mean, std = (CLIP_MEAN, CLIP_STD) if clip else ((0.5,) * 3, (0.5,) * 3)
    if doc.get("do_normalize", True):
        mean, std = tuple(doc.get("image_mean", mean)), tuple(doc.get("image_std", std))
    else:
        mean, std = (0.0,) * 3, (1.0,) * 3
    scale = doc.get("rescale_factor", 1 / 255) if doc.get("do_rescale", True) else None
    if scale is None or abs(float(scale) * 255 - 1) > 1e-6:
        raise CheckpointError(f"{src}: rescale_factor {scale!r} is not supported (only 1/255)")
    if not doc.get("do_resize", True):
        raise CheckpointError(f"{src}: do_resize false is not supported (vitkit always resizes)")
    resample = doc.get("resample", 3)
    if resample not in RESAMPLE:
        raise CheckpointError(f"{src}: resample {resample!r} is not supported (known: {sorted(RESAMPLE)})")
    size = doc.get(
        "size", {"shortest_edge": image_size[0]} if clip else {"height": image_size[0], "width": image_size[1]}
    )
    kw: dict[str, Any] = {"resize": "squash"}
    if (isinstance(size, dict) and "shortest_edge" in size) or (clip and isinstance(size, int)):
        (short,) = _side(size, ("shortest_edge",), "size", src)
        if not doc.get("do_center_crop", clip):
            raise CheckpointError(f"{src}: do_center_crop false with size.shortest_edge is not supported")
        crop = _side(doc.get("crop_size", image_size[0]), ("height", "width"), "crop_size", src)
        if short < max(crop):
            raise CheckpointError(f"{src}: crop_size {list(crop)} larger than size.shortest_edge {short}")
        kw = {"resize": "shortest", "crop_pct": min(crop) / short, "image_size": crop}
    else:
        kw["image_size"] = _side(size, ("height", "width"), "size", src)
        crop = doc.get("crop_size", kw["image_size"])
        if doc.get("do_center_crop", False) and _side(crop, ("height", "width"), "crop_size", src) != kw["image_size"]:
            raise CheckpointError(
                f"{src}: crop_size {crop!r} after a resize to {list(kw['image_size'])} is not supported"
            )
    with refusing(src):
        return Preprocess(mean=mean, std=std, interpolation=RESAMPLE[resample], **kw)


def preprocessor_config(family: str, pre: Preprocess) -> dict[str, Any] | None:
    """The image processor that computes ``pre``, or None when the family's processor cannot."""
    H, W = pre.image_size
    doc: dict[str, Any] = {
        "image_processor_type": "CLIPImageProcessor" if family == "clip" else "SiglipImageProcessor",
        "do_resize": True,
        **hf.processor_fields(pre),
        "do_convert_rgb": True,
    }
    if pre.resize == "squash":
        return {**doc, "size": {"height": H, "width": W}, "do_center_crop": False}
    short = round(min(H, W) / pre.crop_pct)
    if family != "clip" or pre.resize != "shortest" or short < max(H, W):
        return None
    return {**doc, "size": {"shortest_edge": short}, "do_center_crop": True, "crop_size": {"height": H, "width": W}}


# ---- load and save --------------------------------------------------------------------------------


def load(path: Path, doc: Mapping[str, Any]) -> Checkpoint:
    """Read a CLIP/SigLIP vision (or full text+vision) folder: the image tower, shape-checked, with its
    preprocessing."""
    source = str(path)
    family, full, v = vision_doc(doc, source)
    weights = torch_files.read_folder_weights(path)
    prefix = "vision_model." if full or any(k.startswith("vision_model.") for k in weights) else ""
    cfg = hf.parse_config(path, lambda: config_from_hf(family, v, source))
    text = sorted(k for k in weights if full and k.startswith(TEXT_KEYS))
    tower = {k: t for k, t in weights.items() if k not in text}
    split_in_proj(tower, prefix)
    buffer = f"{prefix}embeddings.position_ids"  # arange(T), saved by older transformers
    state = convert(cfg, tower, source, lambda c: key_map(c, family, prefix), ignore=lambda k: k == buffer)
    name = {"clip": "CLIP", "siglip": "Siglip"}[family]
    layout = f"transformers {name}Model, vision tower only" if full else f"transformers {name}VisionModel"
    provenance = hf.provenance(layout, doc, f"the text tower ({len(text)} tensors)" if text else None)
    return hf.checkpoint(path, cfg, state, provenance, lambda: preprocess_from(path, family, cfg.image_size))


def family_of(cfg: ViTConfig) -> str | None:
    """The family whose layout a vitkit model is written in: CLIP's markers (pre-norm, projection, QuickGELU,
    no patch bias) or SigLIP's (MAP pooling without a class token); None: a plain transformers ViT."""
    if cfg.norm_pre or cfg.projection_size or cfg.gelu == "quick" or not cfg.patch_bias:
        return "clip"
    if cfg.classifier == "map" and not cfg.class_token:
        return "siglip"
    return None


def claims(cfg: ViTConfig) -> bool:
    """Whether :func:`save` (not the plain ViT writer) writes this model."""
    return family_of(cfg) is not None


def unrepresentable(cfg: ViTConfig, family: str) -> str | None:
    """Why transformers' CLIP/SigLIP vision tower cannot compute this model's function (None when it can)."""
    clip = family == "clip"
    checks = [  # (representable, what this model has that the tower lacks)
        (cfg.resnet_layers is None, "a hybrid ResNet stem"),
        (cfg.num_classes == 0 and cfg.representation_size is None, "a classifier head or pre-logits layer"),
        (cfg.image_size[0] == cfg.image_size[1], f"a non-square image size {list(cfg.image_size)}"),
        (cfg.pos_embed == "learned", f"a {cfg.pos_embed!r} position embedding (not a learned one)"),
        (cfg.num_pos_prefix == int(bool(cfg.class_token)), "a class token without a position slot"),
        (not cfg.distilled and cfg.num_registers == 0, "distillation or register tokens"),
        (cfg.rope is None and cfg.layer_scale is None and cfg.mlp == "plain", "RoPE, layer scale or a SwiGLU MLP"),
        (cfg.qkv_bias and cfg.key_bias, "attention without q/k/v biases"),
        (cfg.classifier == ("token" if clip else "map"), f"pooling {cfg.classifier!r}"),
        (cfg.class_token == clip, "no class token" if clip else "a class token"),
        (cfg.norm_pre == clip, "no pre-norm (pre_layrnorm)" if clip else "a pre-norm"),
        (cfg.patch_bias != clip, "a patch-embedding bias" if clip else "no patch-embedding bias"),
        (clip or cfg.projection_size is None, "an image projection"),
    ]
    bad = [what for ok, what in checks if not ok]
    return f"transformers' {family.upper()} vision tower cannot compute this model: it has {bad[0]}" if bad else None


def hf_config(cfg: ViTConfig, family: str) -> dict[str, Any]:
    """config.json for ``CLIPVisionConfig`` / ``SiglipVisionConfig``."""
    clip = family == "clip"
    arch = (
        ("CLIPVisionModelWithProjection" if cfg.projection_size else "CLIPVisionModel") if clip else "SiglipVisionModel"
    )
    doc: dict[str, Any] = {
        "architectures": [arch],
        "model_type": f"{family}_vision_model",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "num_channels": cfg.in_channels,
        "image_size": cfg.image_size[0],
        "patch_size": cfg.patch_size,
        "hidden_act": ACT_NAME[cfg.gelu],
        "layer_norm_eps": cfg.layer_norm_eps,
        "attention_dropout": cfg.attention_dropout,
        "dtype": "float32",
    }
    if clip and cfg.projection_size:
        doc["projection_dim"] = cfg.projection_size
    if not clip:
        doc["vision_use_head"] = True
    return doc


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write ``model`` as the transformers folder of its family (:func:`family_of`), in the names transformers
    writes itself: ``CLIPVisionModel`` and ``SiglipVisionModel`` unprefixed, ``CLIPVisionModelWithProjection``
    under ``vision_model.``. The preprocessing is written when the family's image processor computes it."""
    torch_files.check_folder_output(Path(path), overwrite)
    cfg, state = with_learned_posemb(model.cfg, export_state(model))  # a sin-cos table: the same function
    family = family_of(cfg) or "clip"
    why = unrepresentable(cfg, family)
    require(why is None, f"a transformers {family.upper()} vision folder", why or "")
    prefix = "vision_model." if cfg.projection_size else ""
    arrays = from_state_dict(key_map(cfg, family, prefix), state)
    join_in_proj(arrays, prefix)
    pre = preprocessor_config(family, meta.preprocess if meta else Preprocess(image_size=cfg.image_size))
    return hf.write_folder(path, torch_files.from_arrays(arrays), hf_config(cfg, family), pre, overwrite)


# config.json's model_type -> this module's reader and writer (:func:`vitkit.checkpoints.hf_folder.families`)
FAMILIES = {
    t: Family(load, lambda model, path, meta, overwrite: save(model, path, meta, overwrite=overwrite), claims)
    for t in ("clip_vision_model", "clip", "siglip_vision_model", "siglip")
}
