"""The bounds and checks of a :class:`vitkit.models.vit.ViTConfig` (``ViTConfig.validate`` calls
:func:`check_config`), kept beside the model so that ``models/vit.py`` reads like the paper.

Configs come from untrusted files: types, ranges and sizes are checked before anything is allocated.
"""

from __future__ import annotations

import math
from typing import Any

from vitkit.models.resnet import GN_GROUPS, resnet_root_width

# Upper bounds of a config's sizes: far above any published ViT (ViT-22B: width 6144, MLP 24576, depth 48),
# they keep a hostile config.json from asking for unbounded memory before anything else can be checked.
_MAX_WIDTH = 1 << 16
_MAX_TOKENS = 1 << 20
_MAX_IMAGE_SIDE = 1 << 16
_MAX_RESNET_STAGES, _MAX_RESNET_UNITS = 8, 64
MAX_CLASSES = 10_000_000  # classes of a head, and labels anywhere (a label file sizes an allocation by its max)
_INT_RANGES = {
    "patch_size": (1, 4096),
    "in_channels": (1, 1024),
    "num_classes": (0, MAX_CLASSES),
    "hidden_size": (1, _MAX_WIDTH),
    "depth": (1, 1024),
    "num_heads": (1, _MAX_WIDTH),
    "mlp_dim": (1, 4 * _MAX_WIDTH),
}


_CHOICES: dict[str, tuple[Any, ...]] = {
    "classifier": ("token", "gap", "map"),
    "pos_embed": ("learned", "sincos2d", "none"),
    "gelu": ("exact", "tanh", "quick"),
    "mlp": ("plain", "swiglu"),
    "rope": (None, "dinov3", "eva"),
    "pos_resample": ("bilinear", "bicubic", "bicubic_plain", "bicubic_offset"),
}
_MAX_REGISTERS = 1024


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON's true/false are not sizes)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(cfg: Any) -> None:
    """A ``ViTConfig``'s types, ranges and sizes, checked before anything is allocated (configs come from
    untrusted files): every size has an upper bound far above any published ViT, so a hostile config cannot ask
    for unbounded memory; checkpoint loaders also check the size against the tensors in the file."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"invalid ViT config: {msg}")

    for name, (lo, hi) in _INT_RANGES.items():
        value = getattr(cfg, name)
        if not is_int(value):
            raise bad(f"{name} must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise bad(f"{name} {value} is outside {lo}..{hi}")
    if cfg.representation_size is not None and not (
        is_int(cfg.representation_size) and 1 <= cfg.representation_size <= _MAX_WIDTH
    ):
        raise bad(f"representation_size must be None or an integer in 1..{_MAX_WIDTH}")
    for name in ("dropout", "attention_dropout", "drop_path", "layer_norm_eps", "head_bias_init", "resnet_width"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name} must be a finite number, got {value!r}")
    if cfg.resnet_width > 64:
        raise bad(f"resnet_width must be at most 64, got {cfg.resnet_width!r}")
    if not 0.0 < cfg.layer_norm_eps <= 1.0:
        raise bad(f"layer_norm_eps must be in (0, 1], got {cfg.layer_norm_eps!r}")
    if not isinstance(cfg.qkv_bias, bool):
        raise bad(f"qkv_bias must be true or false, got {cfg.qkv_bias!r}")
    if cfg.resnet_layers is not None and (
        len(cfg.resnet_layers) > _MAX_RESNET_STAGES or max(cfg.resnet_layers, default=1) > _MAX_RESNET_UNITS
    ):
        raise bad(f"resnet_layers: at most {_MAX_RESNET_STAGES} stages of at most {_MAX_RESNET_UNITS} units")
    for side in cfg.image_size:
        if not 0 < side <= _MAX_IMAGE_SIDE:
            raise bad(f"image size {cfg.image_size} is outside 1..{_MAX_IMAGE_SIDE} pixels per side")
    if cfg.hidden_size % cfg.num_heads:
        raise bad(f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    for side in cfg.image_size:
        if side <= 0 or side % cfg.stride:
            what = "patch size" if cfg.resnet_layers is None else "hybrid stride (ResNet x patch)"
            raise bad(f"image size {cfg.image_size} is not a multiple of {what} {cfg.stride}")
    if cfg.resnet_layers is not None:
        if min(cfg.resnet_layers, default=1) < 1:
            raise bad("resnet_layers must be positive stage depths")
        root = resnet_root_width(cfg.resnet_width)
        if root < GN_GROUPS or root % GN_GROUPS:
            raise bad(
                f"resnet_width {cfg.resnet_width} gives a ResNet root of {root} channels; the official "
                f"GroupNorm ({GN_GROUPS} groups) needs a positive multiple of {GN_GROUPS}"
            )
    for name, options in _CHOICES.items():
        if getattr(cfg, name) not in options:
            raise bad(f"{name} must be one of {', '.join(map(repr, options))}, got {getattr(cfg, name)!r}")
    _check_descendants(cfg, bad)
    if cfg.pos_embed == "sincos2d" and cfg.hidden_size % 4:
        raise bad("sincos2d position embeddings need hidden_size divisible by 4")
    for name in ("dropout", "attention_dropout", "drop_path"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise bad(f"{name} must be in [0, 1)")
    gh, gw = cfg.grid_size
    if gh * gw > _MAX_TOKENS:
        raise bad(f"{gh}x{gw} = {gh * gw} tokens; at most {_MAX_TOKENS} (image size / patch size)")


def _check_descendants(cfg: Any, bad: Any) -> None:
    """The options after the paper's (``vitkit.models.config``): types, and the combinations that mean nothing."""
    for name in ("class_token", "distilled", "pos_embed_prefix", "norm_pre", "patch_bias", "key_bias", "mlp_norm",
                 "attn_norm", "fc_norm"):  # fmt: skip
        if not isinstance(getattr(cfg, name), bool):
            raise bad(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if not (is_int(cfg.num_registers) and 0 <= cfg.num_registers <= _MAX_REGISTERS):
        raise bad(f"num_registers must be an integer in 0..{_MAX_REGISTERS}, got {cfg.num_registers!r}")
    for name in ("layer_scale", "rope_theta"):
        value = getattr(cfg, name)
        if value is None and name == "layer_scale":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name} must be a finite number, got {value!r}")
    if cfg.rope_theta <= 0:
        raise bad(f"rope_theta must be positive, got {cfg.rope_theta!r}")
    if cfg.projection_size is not None and not (is_int(cfg.projection_size) and 1 <= cfg.projection_size <= _MAX_WIDTH):
        raise bad(f"projection_size must be None or an integer in 1..{_MAX_WIDTH}")
    if cfg.projection_size is not None and cfg.representation_size is not None:
        raise bad("projection_size and representation_size are two pre-logits layers; give one")
    if cfg.classifier == "token" and not cfg.class_token:
        raise bad("classifier 'token' needs class_token")
    if cfg.distilled and not (cfg.class_token and cfg.classifier == "token"):
        raise bad("distilled (DeiT's distillation token) needs classifier 'token' with a class token")
    if cfg.distilled and cfg.representation_size is not None:
        raise bad("distilled models average two heads on the tokens: no representation_size (pre-logits layer)")
    if cfg.rope is not None:
        if cfg.pos_embed != "none" and not (cfg.rope == "eva" and cfg.pos_embed == "learned"):
            raise bad(f"rope {cfg.rope!r} replaces the position embedding: pos_embed must be 'none'")
        if cfg.head_dim % 4:
            raise bad(f"rope needs a head width (hidden_size / num_heads) divisible by 4, got {cfg.head_dim}")
    if cfg.rope_ref_grid is not None and cfg.rope != "eva":
        raise bad("rope_ref_grid scales EVA-02's RoPE coordinates: it needs rope 'eva'")
    if cfg.fc_norm and cfg.classifier != "gap":
        raise bad("fc_norm normalises the mean of the patch tokens: it needs classifier 'gap'")
    if not cfg.key_bias and not cfg.qkv_bias:
        raise bad("key_bias false only masks the key part of a qkv bias: it needs qkv_bias")
    if cfg.mlp == "swiglu" and cfg.gelu != "exact":
        raise bad("the swiglu MLP gates with SiLU: gelu must stay 'exact' (it is not used)")
    if cfg.resnet_layers is not None and (cfg.norm_pre or not cfg.patch_bias or cfg.num_registers or cfg.distilled):
        raise bad(
            "hybrid (ResNet) models take the paper's stem: no norm_pre, registers, distillation, patch_bias false"
        )
