"""Hugging Face ``transformers`` DINOv3 ViT folders: ``model_type`` dinov3_vit (``DINOv3ViTModel``).

:mod:`vitkit.checkpoints.hf_folder` hands these folders here by ``config.json``'s ``model_type``. The model is
vitkit's ViT with the options DINOv3 uses (``vitkit.models.config``): no learned position embedding
(``pos_embed="none"``), RoPE on the patch tokens' q and k (``rope="dinov3"``, ``rope_theta``; the table of
``models/rope.py`` is transformers' ``DINOv3ViTRopePositionEmbedding`` at inference), ``num_register_tokens``
registers after the class token, layer scale, no key bias (``key_bias=False``: the query and value biases are
``q_bias``/``v_bias``), and the gated MLP of the larger models (``use_gated_mlp``: silu(gate) * up, vitkit's
``mlp="swiglu"`` with ``intermediate_size`` as its width). Pooling: the class token after the final norm
(``pooler_output``).

Names, as the hub's ``model.safetensors`` holds them (``save_pretrained`` of transformers 4.56; transformers 5
renames ``layer.`` to ``model.layer.`` in memory, and both are read)::

    embeddings.{cls_token (1, 1, D), mask_token (1, 1, D), register_tokens (1, R, D), patch_embeddings.{weight,bias}}
    layer.{i}.{norm1, attention.{q,k,v,o}_proj, layer_scale1.lambda1, norm2,
               mlp.{up_proj, down_proj} or mlp.{gate_proj, up_proj, down_proj}, layer_scale2.lambda1}
    norm

``mask_token`` serves masked-image-modelling inputs only: ignored on reading, written as zeros;
``register_tokens`` is written (1, 0, D) for a model without registers, as transformers holds it.

Every option comes from ``config.json`` (DINOv3ViTConfig's defaults where a field is absent) and is checked
against the weights' shapes; what vitkit's model cannot compute is refused in one line naming the field:
``query_bias`` differing from ``value_bias``, a ``key_bias`` without the others, ``proj_bias``/``mlp_bias``
false, a gated MLP whose ``hidden_act`` is not silu. ``pos_embed_shift``/``jitter``/``rescale`` and
``drop_path_rate`` act in training mode only (transformers' coordinate augmentations): not read; the
backbone-only fields (``out_features``, ``apply_layernorm``) neither.

``preprocessor_config.json`` (DINOv3ViTImageProcessor: resize to ``size`` {height, width}, bilinear, no crop,
ImageNet mean/std by default) as a :class:`Preprocess`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.checkpoints import hf, hf_dino, torch_files
from vitkit.checkpoints.hf import CONFIG, PREPROCESSOR, _pair
from vitkit.checkpoints.keymap import Rule, expand, from_state_dict, rule, stacked, weight_bias
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    require,
)
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

MODEL_TYPE, ARCH, PROCESSOR = "dinov3_vit", "DINOv3ViTModel", "DINOv3ViTImageProcessorFast"
# DINOv3ViTConfig's defaults (transformers 5.24), for fields a config.json leaves out
DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "hidden_act": "gelu",
    "attention_dropout": 0.0,
    "layer_norm_eps": 1e-5,
    "rope_theta": 100.0,
    "image_size": 224,
    "num_channels": 3,
    "query_bias": True,
    "key_bias": False,
    "value_bias": True,
    "proj_bias": True,
    "mlp_bias": True,
    "layerscale_value": 1.0,
    "use_gated_mlp": False,
    "num_register_tokens": 0,
}
SILU = ("silu", "swish")
# DINOv3ViTImageProcessor's defaults
PROCESSOR_DEFAULTS: dict[str, Any] = {"size": {"height": 224, "width": 224}, "resample": 2, "do_center_crop": False}


# ---- rule table --------------------------------------------------------------------------------------


def key_map(cfg: ViTConfig, layer: str = "layer.") -> list[Rule]:
    """DINOv3ViTModel names for a model with this config (``layer``: "layer." as saved, "model.layer." in memory)."""
    e, blk = "embeddings.", f"{layer}{{i}}."
    q, k, v = (f"{blk}attention.{n}_proj" for n in ("q", "k", "v"))
    rules: list[Rule] = [
        rule("cls_token", f"{e}cls_token"),
        *weight_bias("patch_embed.proj", f"{e}patch_embeddings", cfg.patch_bias),
        *weight_bias("blocks.{i}.norm1", f"{blk}norm1"),
        stacked("blocks.{i}.attn.qkv.weight", [f"{n}.weight" for n in (q, k, v)]),
        *weight_bias("blocks.{i}.attn.proj", f"{blk}attention.o_proj"),
        rule("blocks.{i}.ls1.gamma", f"{blk}layer_scale1.lambda1"),
        *weight_bias("blocks.{i}.norm2", f"{blk}norm2"),
        *weight_bias("blocks.{i}.mlp.fc2", f"{blk}mlp.down_proj"),
        rule("blocks.{i}.ls2.gamma", f"{blk}layer_scale2.lambda1"),
        *weight_bias("norm", "norm"),
    ]
    if cfg.mlp == "swiglu":  # vitkit's fc1 = [gate rows; up rows]
        gate, up = f"{blk}mlp.gate_proj", f"{blk}mlp.up_proj"
        rules += [stacked(f"blocks.{{i}}.mlp.fc1.{p}", [f"{gate}.{p}", f"{up}.{p}"]) for p in ("weight", "bias")]
    else:
        rules += weight_bias("blocks.{i}.mlp.fc1", f"{blk}mlp.up_proj")
    if cfg.qkv_bias and cfg.key_bias:
        rules.append(stacked("blocks.{i}.attn.qkv.bias", [f"{n}.bias" for n in (q, k, v)]))
    elif cfg.qkv_bias:
        rules += [rule("blocks.{i}.attn.q_bias", f"{q}.bias"), rule("blocks.{i}.attn.v_bias", f"{v}.bias")]
    if cfg.num_registers:
        rules.append(rule("reg_token", f"{e}register_tokens"))
    return expand(rules, cfg.depth)


# ---- config.json -------------------------------------------------------------------------------------


def _flag(doc: Mapping[str, Any], key: str, source: str) -> bool:
    value = doc.get(key, DEFAULTS[key])
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key} {value!r} is not a boolean")
    return value


def dinov3_config(doc: Mapping[str, Any], source: str) -> ViTConfig:
    """vitkit's config from a DINOv3ViTConfig config.json; what vitkit cannot compute is one line naming the field."""

    def get(key: str) -> Any:
        return doc.get(key, DEFAULTS[key])

    q, k, v = (_flag(doc, f"{n}_bias", source) for n in ("query", "key", "value"))
    if q != v:
        raise CheckpointError(f"{source}: query_bias {q} with value_bias {v} is not supported (both or neither)")
    if k and not q:
        raise CheckpointError(f"{source}: key_bias true without query_bias and value_bias is not supported")
    for key in ("proj_bias", "mlp_bias"):
        if not _flag(doc, key, source):
            raise CheckpointError(f"{source}: {key} false is not supported (vitkit's projections have biases)")
    gated = _flag(doc, "use_gated_mlp", source)
    act = get("hidden_act")
    if gated and act not in SILU:
        raise CheckpointError(f"{source}: hidden_act {act!r} with use_gated_mlp is not supported (silu only)")
    gelu = "exact" if gated else hf.gelu_of(doc, source)  # DEFAULTS' hidden_act is gelu_of's default
    layer_scale = get("layerscale_value")
    if not isinstance(layer_scale, (int, float)) or isinstance(layer_scale, bool):
        raise CheckpointError(f"{source}: layerscale_value {layer_scale!r} is not a number")
    ph, pw = _pair(get("patch_size"), "patch_size", source)
    if ph != pw:
        raise CheckpointError(f"{source}: patch_size {ph}x{pw} is not supported (square patches only)")
    return ViTConfig(
        image_size=_pair(get("image_size"), "image_size", source),
        patch_size=ph,
        in_channels=int(get("num_channels")),
        num_classes=0,
        hidden_size=int(get("hidden_size")),
        depth=int(get("num_hidden_layers")),
        num_heads=int(get("num_attention_heads")),
        mlp_dim=int(get("intermediate_size")),
        attention_dropout=float(get("attention_dropout")),
        gelu=gelu,  # type: ignore[arg-type]
        layer_norm_eps=float(get("layer_norm_eps")),
        qkv_bias=q,
        num_registers=int(get("num_register_tokens")),
        pos_embed="none",
        rope="dinov3",
        rope_theta=float(get("rope_theta")),
        layer_scale=float(layer_scale),
        mlp="swiglu" if gated else "plain",
        key_bias=k or not q,
    )


def config_json(cfg: ViTConfig) -> dict[str, Any]:
    """The DINOv3ViTConfig fields of ``cfg`` (the training-only augmentations at transformers' defaults)."""
    return {
        "architectures": [ARCH],
        "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "hidden_act": "silu" if cfg.mlp == "swiglu" else ("gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh"),
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.layer_norm_eps,
        "rope_theta": cfg.rope_theta,
        "image_size": cfg.image_size[0] if cfg.image_size[0] == cfg.image_size[1] else list(cfg.image_size),
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_channels,
        "query_bias": cfg.qkv_bias,
        "key_bias": cfg.qkv_bias and cfg.key_bias,
        "value_bias": cfg.qkv_bias,
        "proj_bias": True,
        "mlp_bias": True,
        "layerscale_value": cfg.layer_scale,
        "drop_path_rate": 0.0,
        "use_gated_mlp": cfg.mlp == "swiglu",
        "num_register_tokens": cfg.num_registers,
        "pos_embed_shift": None,
        "pos_embed_jitter": None,
        "pos_embed_rescale": 2.0,
        "dtype": "float32",
    }


# ---- preprocessor_config.json ------------------------------------------------------------------------


def preprocess_from(folder: Path, image_size: tuple[int, int]) -> Preprocess:
    """A DINOv3ViTImageProcessor config as a Preprocess (its defaults for absent fields: a bilinear squash to 224 x
    224, ImageNet statistics; no file: the same squash to the model's size)."""
    path = folder / PREPROCESSOR
    doc: dict[str, Any] = hf._read_json(path) if path.is_file() else {}
    source = str(path)
    defaults = dict(PROCESSOR_DEFAULTS)
    if not path.is_file():  # no processor: the model's own size
        defaults["size"] = {"height": image_size[0], "width": image_size[1]}
    full = {**defaults, **{k: v for k, v in doc.items() if v is not None}}
    if full.get("do_center_crop") and "crop_size" not in full:
        raise CheckpointError(f"{source}: do_center_crop without crop_size is not supported")
    return hf_dino.processor_preprocess(full, source)


def preprocessor_config(pre: Preprocess) -> dict[str, Any] | None:
    """``pre`` as a DINOv3ViTImageProcessor config (a resize to a size, optionally a centre crop after it); None for
    a shorter-side resize, which that processor does not compute."""
    doc = hf_dino.preprocessor_config(pre, "DeiTImageProcessor")  # the same fields: size, crop, resample, stats
    return None if doc is None else {**doc, "image_processor_type": PROCESSOR}


# ---- reading -----------------------------------------------------------------------------------------


def load(path: Path, doc: Mapping[str, Any]) -> Checkpoint:
    """A DINOv3ViTModel folder."""
    source = str(path / CONFIG)
    weights = dict(torch_files.read_folder_weights(path))
    if any(k.startswith("model.layer.") for k in weights):  # transformers 5's in-memory names
        weights = {("layer." + k[len("model.layer.") :] if k.startswith("model.layer.") else k): t
                   for k, t in weights.items()}  # fmt: skip
    if any(k.startswith(("dinov3.", "classifier.")) for k in weights):
        raise CheckpointError(f"{path}: a DINOv3 classification head is not supported; save the DINOv3ViTModel")
    cfg = hf.parse_config(path, lambda: dinov3_config(doc, source))
    ignored = {"embeddings.mask_token", "rope_embeddings.inv_freq"}
    reg = weights.get("embeddings.register_tokens")
    if cfg.num_registers == 0 and reg is not None and reg.numel() == 0:
        ignored.add("embeddings.register_tokens")  # transformers' (1, 0, D) parameter
    state = convert(cfg, weights, str(path), key_map, ignore=lambda k: k in ignored)
    provenance = hf.provenance(f"transformers {ARCH}", doc, sorted(ignored & set(weights)))
    return hf.checkpoint(path, cfg, state, provenance, lambda: preprocess_from(path, cfg.image_size))


# ---- writing -----------------------------------------------------------------------------------------


def unrepresentable(cfg: ViTConfig) -> str | None:
    checks = [
        (cfg.num_classes > 0, "DINOv3ViTModel has no classifier (export with num_classes=0)"),
        (cfg.resnet_layers is not None, "no hybrid ResNet stem"),
        (cfg.classifier != "token" or not cfg.class_token, "it pools the class token"),
        (cfg.distilled, "no distillation token"),
        (cfg.representation_size is not None or cfg.projection_size is not None, "no pre-logits or projection"),
        (cfg.norm_pre, "no pre-norm"),
        (not cfg.patch_bias, "a patch projection bias"),
        (cfg.layer_scale is None, "layer scale on both branches"),
        (cfg.mlp == "swiglu" and cfg.gelu != "exact", "a silu-gated MLP (no GELU setting beside it)"),
        (cfg.gelu == "quick", "no quick GELU"),
        (cfg.dropout > 0, "no hidden dropout"),
    ]
    return next((f"transformers' DINOv3: {why}" for bad, why in checks if bad), None)


def save(model: VisionTransformer, path: Path, meta: CheckpointMeta | None, overwrite: bool) -> Path:
    """``model`` as a DINOv3ViTModel folder."""
    cfg = model.cfg
    why = unrepresentable(cfg)
    require(why is None, "a transformers DINOv3 folder", why or "")
    arrays = from_state_dict(key_map(cfg), export_state(model))
    arrays["embeddings.mask_token"] = np.zeros((1, 1, cfg.hidden_size), np.float32)
    if not cfg.num_registers:
        arrays["embeddings.register_tokens"] = np.zeros((1, 0, cfg.hidden_size), np.float32)
    pre = preprocessor_config(meta.preprocess) if meta else None
    return hf.write_folder(path, torch_files.from_arrays(arrays), config_json(cfg), pre, overwrite)


# a model with DINOv3's RoPE is written as DINOv3
FAMILIES = {MODEL_TYPE: hf.Family(load, save, lambda cfg: cfg.rope == "dinov3")}
