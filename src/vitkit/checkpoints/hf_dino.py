"""Hugging Face ``transformers`` DINOv2 and DeiT folders: ``model_type`` dinov2, dinov2_with_registers, deit.

:mod:`vitkit.checkpoints.hf` reads ``config.json``'s ``model_type`` and hands these folders to :data:`FAMILIES`.
Weights are read and written under the names that ``save_pretrained`` writes and the hub holds:

- ``Dinov2Model`` / ``Dinov2WithRegistersModel`` (no prefix): ``embeddings.{cls_token, mask_token,
  position_embeddings, register_tokens, patch_embeddings.projection}``, ``encoder.layer.{i}.{norm1,
  attention.attention.{query,key,value}, attention.output.dense, layer_scale1.lambda1, norm2, mlp.fc1/fc2 or
  mlp.weights_in/weights_out (SwiGLU: gate rows then up rows, as vitkit's fc1), layer_scale2.lambda1}``,
  ``layernorm``. The position embedding has the class token's slot, the registers none (vitkit's
  ``pos_embed_prefix`` with ``num_registers``). transformers resamples it for other sizes with plain bicubic
  (DINOv2: ``pos_resample="bicubic_plain"``) or antialiased bicubic (with registers: ``"bicubic"``).
  ``mask_token`` is used only for masked-image-modelling inputs: ignored on reading, written as zeros.
- ``DeiTModel`` (no prefix) / ``DeiTForImageClassificationWithTeacher`` (``deit.``): ViT's hub names plus
  ``embeddings.distillation_token``; the two heads ``cls_classifier`` and ``distillation_classifier`` (averaged:
  vitkit's ``distilled`` head and ``head_dist``). DeiTModel's pooler (Dense + tanh on the class token alone) is
  not vitkit's pooling (the mean of the class and distillation tokens, which both heads see): ignored and
  reported; a DeiTModel is written without one (``from_pretrained(..., add_pooling_layer=False)``).

Every architecture option comes from ``config.json`` (HF's defaults where a field is absent) and is checked
against the weights' shapes. ``preprocessor_config.json`` (BitImageProcessor, DeiTImageProcessor): resize
``{shortest_edge}`` or ``{height, width}``, ``crop_size``, resample, mean/std, as a :class:`Preprocess`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import hf, torch_files
from vitkit.checkpoints.hf import CONFIG, PREPROCESSOR, RESAMPLE, _pair
from vitkit.checkpoints.keymap import Rule, expand, from_state_dict, rule, stacked, weight_bias
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    require,
    with_learned_posemb,
)
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

DINO, DINO_REG, DEIT = "dinov2", "dinov2_with_registers", "deit"
ARCH = {DINO: "Dinov2Model", DINO_REG: "Dinov2WithRegistersModel"}
PROCESSOR = {DINO: "BitImageProcessor", DINO_REG: "BitImageProcessor", DEIT: "DeiTImageProcessor"}
# the resize modes each image processor computes (preprocess.py's module docstring)
PROCESSOR_MODES = {"BitImageProcessor": ("shortest", "squash"), "DeiTImageProcessor": ("squash_crop", "squash")}
# how transformers resamples the position embedding at another size (its interpolate_pos_encoding)
POS_RESAMPLE = {DINO: "bicubic_plain", DINO_REG: "bicubic", DEIT: "bicubic_plain"}
# HF's config defaults, for fields a config.json leaves out
DINO_DEFAULTS: dict[str, Any] = {"image_size": 224, "patch_size": 14, "layer_norm_eps": 1e-6, "mlp_ratio": 4}
DEIT_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "patch_size": 16,
    "layer_norm_eps": 1e-12,
    "intermediate_size": 3072,
}


# ---- rule tables -------------------------------------------------------------------------------------


def dino_key_map(cfg: ViTConfig) -> list[Rule]:
    """Dinov2Model / Dinov2WithRegistersModel names for a model with this config."""
    e, layer = "embeddings.", "encoder.layer.{i}."
    q, k, v = (f"{layer}attention.attention.{n}" for n in ("query", "key", "value"))
    fc1, fc2 = (f"{layer}mlp.{n}" for n in (("weights_in", "weights_out") if cfg.mlp == "swiglu" else ("fc1", "fc2")))
    rules: list[Rule] = [
        rule("cls_token", f"{e}cls_token"),
        rule("pos_embed", f"{e}position_embeddings"),
        *weight_bias("patch_embed.proj", f"{e}patch_embeddings.projection"),
        *weight_bias("blocks.{i}.norm1", f"{layer}norm1"),
        stacked("blocks.{i}.attn.qkv.weight", [f"{n}.weight" for n in (q, k, v)]),
        *weight_bias("blocks.{i}.attn.proj", f"{layer}attention.output.dense"),
        rule("blocks.{i}.ls1.gamma", f"{layer}layer_scale1.lambda1"),
        *weight_bias("blocks.{i}.norm2", f"{layer}norm2"),
        *weight_bias("blocks.{i}.mlp.fc1", fc1),
        *weight_bias("blocks.{i}.mlp.fc2", fc2),
        rule("blocks.{i}.ls2.gamma", f"{layer}layer_scale2.lambda1"),
        *weight_bias("norm", "layernorm"),
    ]
    if cfg.qkv_bias:
        rules.append(stacked("blocks.{i}.attn.qkv.bias", [f"{n}.bias" for n in (q, k, v)]))
    if cfg.num_registers:
        rules.append(rule("reg_token", f"{e}register_tokens"))
    return expand(rules, cfg.depth)


def deit_key_map(cfg: ViTConfig, prefix: str) -> list[Rule]:
    """DeiTModel (``prefix`` "") / DeiTForImageClassificationWithTeacher ("deit.") names: ViT's plus the
    distillation token and the two heads."""
    body = hf.key_map(dataclasses.replace(cfg, num_classes=0, representation_size=None), prefix, "hub")
    rules = [*body, rule("dist_token", f"{prefix}embeddings.distillation_token")]
    if cfg.num_classes > 0:
        rules += weight_bias("head", "cls_classifier") + weight_bias("head_dist", "distillation_classifier")
    return rules


# ---- config.json -------------------------------------------------------------------------------------


def _square(doc: Mapping[str, Any], key: str, default: int, source: str) -> tuple[int, int]:
    h, w = _pair(doc.get(key, default), key, source)
    if h != w:
        raise CheckpointError(f"{source}: {key} {h}x{w} is not supported (square only: transformers' position grid)")
    return h, w


def _check_head_dim(doc: Mapping[str, Any], source: str) -> None:
    head_dim = doc.get("head_dim")
    if head_dim is not None and head_dim * doc.get("num_attention_heads", 12) != doc.get("hidden_size", 768):
        raise CheckpointError(f"{source}: head_dim {head_dim!r} is not supported (only hidden_size / heads)")


def swiglu_width(hidden: int) -> int:
    """transformers' Dinov2SwiGLUFFN width for an MLP of ``hidden``: two thirds, up to a multiple of 8."""
    return (int(hidden * 2 / 3) + 7) // 8 * 8


def dino_config(doc: Mapping[str, Any], model_type: str, source: str) -> ViTConfig:
    """vitkit's config from a Dinov2Config / Dinov2WithRegistersConfig config.json."""
    _check_head_dim(doc, source)
    swiglu = bool(doc.get("use_swiglu_ffn", False))
    gelu = "exact" if swiglu else hf.gelu_of(doc, source)  # the SwiGLU MLP is always silu-gated
    D = int(doc.get("hidden_size", 768))
    hidden = int(D * doc.get("mlp_ratio", DINO_DEFAULTS["mlp_ratio"]))
    layer_scale = doc.get("layerscale_value", 1.0)
    if not isinstance(layer_scale, (int, float)) or isinstance(layer_scale, bool):
        raise CheckpointError(f"{source}: layerscale_value {layer_scale!r} is not a number")
    return ViTConfig(
        image_size=_square(doc, "image_size", DINO_DEFAULTS["image_size"], source),
        patch_size=_square(doc, "patch_size", DINO_DEFAULTS["patch_size"], source)[0],
        in_channels=int(doc.get("num_channels", 3)),
        num_classes=0,
        hidden_size=D,
        depth=int(doc.get("num_hidden_layers", 12)),
        num_heads=int(doc.get("num_attention_heads", 12)),
        mlp_dim=swiglu_width(hidden) if swiglu else hidden,
        dropout=float(doc.get("hidden_dropout_prob", 0.0)),
        attention_dropout=float(doc.get("attention_probs_dropout_prob", 0.0)),
        gelu=gelu,  # type: ignore[arg-type]
        layer_norm_eps=float(doc.get("layer_norm_eps", DINO_DEFAULTS["layer_norm_eps"])),
        qkv_bias=bool(doc.get("qkv_bias", True)),
        num_registers=int(doc.get("num_register_tokens", 4)) if model_type == DINO_REG else 0,
        pos_resample=POS_RESAMPLE[model_type],  # type: ignore[arg-type]
        layer_scale=float(layer_scale),
        mlp="swiglu" if swiglu else "plain",
    )


def deit_config(doc: Mapping[str, Any], num_classes: int, source: str) -> ViTConfig:
    """vitkit's config from a DeiTConfig config.json (``num_classes`` from the weights' heads)."""
    _check_head_dim(doc, source)
    return ViTConfig(
        image_size=_square(doc, "image_size", DEIT_DEFAULTS["image_size"], source),
        patch_size=_square(doc, "patch_size", DEIT_DEFAULTS["patch_size"], source)[0],
        in_channels=int(doc.get("num_channels", 3)),
        num_classes=num_classes,
        hidden_size=int(doc.get("hidden_size", 768)),
        depth=int(doc.get("num_hidden_layers", 12)),
        num_heads=int(doc.get("num_attention_heads", 12)),
        mlp_dim=int(doc.get("intermediate_size", DEIT_DEFAULTS["intermediate_size"])),
        dropout=float(doc.get("hidden_dropout_prob", 0.0)),
        attention_dropout=float(doc.get("attention_probs_dropout_prob", 0.0)),
        gelu=hf.gelu_of(doc, source),  # type: ignore[arg-type]
        layer_norm_eps=float(doc.get("layer_norm_eps", DEIT_DEFAULTS["layer_norm_eps"])),
        qkv_bias=bool(doc.get("qkv_bias", True)),
        distilled=True,
        pos_resample=POS_RESAMPLE[DEIT],  # type: ignore[arg-type]
    )


# ---- preprocessor_config.json ------------------------------------------------------------------------


def _resize_mode(doc: Mapping[str, Any], source: str) -> tuple[tuple[int, int], str, float]:
    """(image size, resize mode, crop_pct) of an image processor's size / crop_size."""
    size = doc.get("size", {"height": 224, "width": 224})
    size = {"height": size, "width": size} if isinstance(size, int) else size
    if not isinstance(size, dict):
        raise CheckpointError(f"{source}: size {size!r} is not supported")
    if not doc.get("do_center_crop", True):
        if "shortest_edge" in size:
            raise CheckpointError(f"{source}: size shortest_edge without do_center_crop is not supported")
        return (int(size["height"]), int(size["width"])), "squash", 1.0
    crop = doc.get("crop_size", {"height": 224, "width": 224})
    crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
    H, W = int(crop["height"]), int(crop["width"])
    if "shortest_edge" in size:
        return (H, W), "shortest", min(H, W) / int(size["shortest_edge"])
    pct = H / int(size["height"])
    if round(W / pct) != int(size["width"]):
        raise CheckpointError(f"{source}: size {size} and crop_size {crop} do not crop both sides alike")
    return (H, W), "squash_crop", pct


def preprocess_from(folder: Path, image_size: tuple[int, int]) -> Preprocess:
    """A BitImageProcessor / DeiTImageProcessor config as a Preprocess (absent: ImageNet statistics, bicubic,
    squashed to the model's size)."""
    path = folder / PREPROCESSOR
    if not path.is_file():
        return Preprocess(image_size=image_size, mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic")
    return processor_preprocess(hf._read_json(path), str(path))


def processor_preprocess(doc: Mapping[str, Any], source: str) -> Preprocess:
    """An image processor's config (BitImageProcessor, DeiTImageProcessor, DINOv3ViTImageProcessor with its
    defaults filled in) as a Preprocess: a resize (and centre crop), rescale by 1/255, normalisation. CheckpointError
    naming ``source`` and the field for anything else."""
    for flag in ("do_resize", "do_rescale"):
        if not doc.get(flag, True):
            raise CheckpointError(f"{source}: {flag} false is not supported")
    if not np.isclose(float(doc.get("rescale_factor", 1 / 255)), 1 / 255, rtol=1e-6, atol=0):
        raise CheckpointError(f"{source}: rescale_factor {doc.get('rescale_factor')!r} is not supported (1/255)")
    resample = int(doc.get("resample", 3))
    if resample not in RESAMPLE:
        raise CheckpointError(f"{source}: resample {resample} is not supported (known: {sorted(RESAMPLE)})")
    normalize = doc.get("do_normalize", True)
    size, mode, pct = _resize_mode(doc, source)
    try:
        return Preprocess(
            image_size=size,
            mean=tuple(doc.get("image_mean", IMAGENET_MEAN)) if normalize else (0.0, 0.0, 0.0),
            std=tuple(doc.get("image_std", IMAGENET_STD)) if normalize else (1.0, 1.0, 1.0),
            resize=mode,
            crop_pct=pct,
            interpolation=RESAMPLE[resample],
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def preprocessor_config(pre: Preprocess, processor: str) -> dict[str, Any] | None:
    """``pre`` as ``processor``'s config; None when that processor cannot compute it."""
    if pre.resize not in PROCESSOR_MODES[processor]:
        return None
    (H, W), pct = pre.image_size, pre.crop_pct
    if pre.resize == "shortest":
        size: dict[str, int] = {"shortest_edge": round(min(H, W) / pct)}
    elif pre.resize == "squash_crop":
        size = {"height": round(H / pct), "width": round(W / pct)}
    else:
        size = {"height": H, "width": W}
    return {
        "image_processor_type": processor,
        "do_resize": True,
        "size": size,
        "do_center_crop": pre.resize != "squash",
        "crop_size": {"height": H, "width": W},
        **hf.processor_fields(pre),
        "do_convert_rgb": True,
    }


# ---- reading -----------------------------------------------------------------------------------------


def _finish(
    path: Path, doc: Mapping[str, Any], cfg: ViTConfig, state: dict[str, torch.Tensor], layout: str, ignored: set[str]
) -> Checkpoint:
    """The folder's checkpoint, its provenance the ``layout``, the weights ``ignored`` (if any), the architectures."""
    provenance: dict[str, Any] = {"layout": layout}
    if ignored:
        provenance["ignored"] = sorted(ignored)
    provenance["architectures"] = doc.get("architectures")
    return hf.checkpoint(path, cfg, state, provenance, lambda: preprocess_from(path, cfg.image_size), doc)


def load_dino(path: Path, doc: Mapping[str, Any]) -> Checkpoint:
    """A Dinov2Model / Dinov2WithRegistersModel folder."""
    model_type = str(doc["model_type"])
    weights = torch_files.read_folder_weights(path)
    if any(k.startswith("dinov2") for k in weights):
        raise CheckpointError(
            f"{path}: Dinov2ForImageClassification (a head on the class and mean patch tokens) is not supported; "
            "save its .dinov2 backbone"
        )
    cfg = hf.parse_config(path, lambda: dino_config(doc, model_type, str(path / CONFIG)))
    ignored = {"embeddings.mask_token"}
    state = convert(cfg, weights, str(path), dino_key_map, ignore=lambda k: k in ignored)
    return _finish(path, doc, cfg, state, f"transformers {ARCH[model_type]}", ignored & set(weights))


def load_deit(path: Path, doc: Mapping[str, Any]) -> Checkpoint:
    """A DeiTModel / DeiTForImageClassificationWithTeacher folder."""
    weights = torch_files.read_folder_weights(path)
    if "classifier.weight" in weights:
        raise CheckpointError(
            f"{path}: DeiTForImageClassification (one head on the class token beside a distillation token) is not "
            "supported; only DeiTModel and DeiTForImageClassificationWithTeacher"
        )
    prefix = "deit." if any(k.startswith("deit.") for k in weights) else ""
    head = weights.get("cls_classifier.weight")
    num_classes = int(head.shape[0]) if head is not None else 0
    cfg = hf.parse_config(path, lambda: deit_config(doc, num_classes, str(path / CONFIG)))
    ignored = {f"{prefix}embeddings.mask_token", f"{prefix}pooler.dense.weight", f"{prefix}pooler.dense.bias"}
    state = convert(cfg, weights, str(path), lambda c: deit_key_map(c, prefix), ignore=lambda k: k in ignored)
    arch = "DeiTForImageClassificationWithTeacher" if cfg.num_classes else "DeiTModel"
    return _finish(path, doc, cfg, state, f"transformers {arch}", ignored & set(weights))


# ---- writing -----------------------------------------------------------------------------------------


def claims_dino(cfg: ViTConfig) -> bool:
    """A model that is written as DINOv2: layer scale, registers or a SwiGLU MLP (and no distillation)."""
    return not cfg.distilled and (cfg.layer_scale is not None or cfg.num_registers > 0 or cfg.mlp == "swiglu")


def _check_representable(cfg: ViTConfig, family: str, *extra: tuple[bool, str]) -> None:
    """CheckpointError ("cannot write a transformers {family} folder") unless transformers' ``family`` computes this
    model: the checks DINOv2 and DeiT share (named for the family), then the ``extra`` (bad, why) of one."""
    checks = [
        (cfg.resnet_layers is not None, "no hybrid ResNet stem"),
        (cfg.classifier != "token", f"it pools the class token; this model uses classifier {cfg.classifier!r}"),
        (cfg.representation_size is not None, "no pre-logits layer"),
        (cfg.image_size[0] != cfg.image_size[1], "a square position grid only"),
        (not cfg.pos_embed_prefix or cfg.rope is not None, "a learned position embedding with prefix slots only"),
        (cfg.norm_pre or cfg.projection_size is not None, "no pre-norm or image projection"),
        (not (cfg.patch_bias and cfg.key_bias), "biases on the patch projection and the key"),
        (cfg.gelu == "quick", "no quick GELU"),
    ]
    common = next((f"transformers' {family}: {why}" for bad, why in checks if bad), None)
    why = common or next((why for bad, why in extra if bad), None)
    require(why is None, f"a transformers {family} folder", why or "")


def _mlp_ratio(cfg: ViTConfig) -> int | None:
    """The (integer: transformers' Dinov2Config types it so) mlp_ratio that gives this MLP width, or None."""
    D = cfg.hidden_size
    for ratio in range(1, 2 * cfg.mlp_dim // D + 2):
        hidden = D * ratio
        if (swiglu_width(hidden) if cfg.mlp == "swiglu" else hidden) == cfg.mlp_dim:
            return ratio
    return None


def dino_config_json(cfg: ViTConfig) -> dict[str, Any]:
    model_type = DINO_REG if cfg.num_registers else DINO
    doc: dict[str, Any] = {
        "architectures": [ARCH[model_type]],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "mlp_ratio": _mlp_ratio(cfg),
        "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.layer_norm_eps,
        "image_size": cfg.image_size[0],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_channels,
        "qkv_bias": cfg.qkv_bias,
        "layerscale_value": cfg.layer_scale,
        "drop_path_rate": 0.0,
        "use_swiglu_ffn": cfg.mlp == "swiglu",
        "dtype": "float32",
    }
    if cfg.num_registers:
        doc["num_register_tokens"] = cfg.num_registers
    return doc


def save_dino(model: VisionTransformer, path: Path, meta: CheckpointMeta | None, overwrite: bool) -> Path:
    """``model`` as a Dinov2Model folder (Dinov2WithRegistersModel with registers)."""
    cfg = model.cfg
    _check_representable(
        cfg,
        "DINOv2",
        (cfg.num_classes > 0, "Dinov2Model has no classifier (export with num_classes=0)"),
        (cfg.layer_scale is None, "transformers' DINOv2 always has layer scale"),
        (_mlp_ratio(cfg) is None, f"no mlp_ratio gives transformers' DINOv2 an MLP width of {cfg.mlp_dim}"),
    )
    cfg, state = with_learned_posemb(cfg, export_state(model))
    tensors = from_state_dict(dino_key_map(cfg), state)
    tensors["embeddings.mask_token"] = np.zeros((1, cfg.hidden_size), np.float32)
    doc = dino_config_json(cfg)
    return _write(path, tensors, doc, meta, PROCESSOR[doc["model_type"]], overwrite)


def save_deit(model: VisionTransformer, path: Path, meta: CheckpointMeta | None, overwrite: bool) -> Path:
    """``model`` as a DeiTForImageClassificationWithTeacher folder (DeiTModel without a head, no pooler)."""
    cfg = model.cfg
    _check_representable(
        cfg,
        "DeiT",
        (cfg.pos_embed != "learned", "a learned position embedding only"),
        (cfg.layer_scale is not None or cfg.num_registers > 0, "no layer scale or registers"),
        (cfg.mlp != "plain", "a plain GELU MLP only"),
    )
    prefix = "deit." if cfg.num_classes > 0 else ""
    tensors = from_state_dict(deit_key_map(cfg, prefix), export_state(model))
    doc = hf.hf_config(cfg, meta.class_names if meta else None)
    arch = "DeiTForImageClassificationWithTeacher" if cfg.num_classes > 0 else "DeiTModel"
    doc.update(architectures=[arch], model_type=DEIT, image_size=cfg.image_size[0])
    return _write(path, tensors, doc, meta, PROCESSOR[DEIT], overwrite)


def _write(
    path: Path,
    arrays: Mapping[str, np.ndarray],
    doc: dict[str, Any],
    meta: CheckpointMeta | None,
    processor: str,
    overwrite: bool,
) -> Path:
    pre = preprocessor_config(meta.preprocess, processor) if meta else None
    return hf.write_folder(path, torch_files.from_arrays(arrays), doc, pre, overwrite)


FAMILIES = {
    DINO: hf.Family(load_dino, save_dino, claims_dino),
    DINO_REG: hf.Family(load_dino, save_dino, lambda cfg: False),  # written by dinov2's saver (registers)
    DEIT: hf.Family(load_deit, save_deit, lambda cfg: cfg.distilled),  # a distilled model is written as DeiT
}
