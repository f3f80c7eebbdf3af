"""Writing timm ``VisionTransformer`` state dicts: a ``.safetensors`` file (timm's config in its metadata), a bare
``.pth`` (only when the shapes and timm's defaults determine the model) or a timm hub folder (``config.json`` plus
``model.safetensors``). The names and semantics are :mod:`vitkit.checkpoints.timm_format`'s, which reads them back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.keymap import from_state_dict
from vitkit.checkpoints.loaded import CheckpointMeta, export_state, require, require_unseen, with_learned_posemb
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.checkpoints.timm_format import ACT_NAMES, HEADS_BY_WIDTH, META_KEY, SUFFIXES, key_map
from vitkit.fileio import WRITER, WRITER_KEY, write_file_atomic
from vitkit.models.vit import VisionTransformer, ViTConfig
from vitkit.output_paths import check_output_file


def timm_config(cfg: ViTConfig, meta: CheckpointMeta | None) -> dict[str, Any]:
    """A timm hub ``config.json``: the architecture plus the model_args that rebuild exactly this model
    (``timm.create_model(architecture, **model_args)``; the architecture supplies only what JSON cannot say:
    DeiT's distilled class, SwiGLUPacked)."""
    pre = meta.preprocess if meta else Preprocess(image_size=cfg.image_size)
    pool = {"token": "token", "gap": "avg", "map": "map"}[cfg.classifier]
    arch = "vit_base_patch16_224"  # any ViT entry point; model_args override every field it sets
    if cfg.distilled:
        arch = "deit_base_distilled_patch16_224"
    elif cfg.mlp == "swiglu":
        arch = "vit_giant_patch14_dinov2"  # mlp_layer=SwiGLUPacked
    num_classes = cfg.num_classes or cfg.projection_size or 0  # timm's CLIP towers: the projection is the head
    hidden = 2 * cfg.mlp_dim if cfg.mlp == "swiglu" else cfg.mlp_dim
    args = {
        **shape_args(cfg),
        "mlp_ratio": mlp_ratio(hidden, cfg.hidden_size),
        "qkv_bias": cfg.qkv_bias,
        "class_token": bool(cfg.class_token),
        "global_pool": pool,
        "fc_norm": False,
        "num_classes": num_classes,
        "act_layer": "silu" if cfg.mlp == "swiglu" else ACT_NAMES[cfg.gelu],
        "init_values": cfg.layer_scale or 0.0,  # not None: timm.create_model drops None, keeping the entry's
        "reg_tokens": cfg.num_registers,
        "no_embed_class": _no_embed_class(cfg),
        "pre_norm": cfg.norm_pre,
        "pool_include_prefix": cfg.classifier == "map" and cfg.num_prefix_tokens > 0,
    }
    doc = hub_config(cfg, arch, num_classes, pool, args, pre, meta)
    if cfg.layer_norm_eps != 1e-6 or cfg.norm_pre:  # timm builds 1e-6 (CLIP's entry points 1e-5): kept for vitkit
        doc["layer_norm_eps"] = cfg.layer_norm_eps
    return doc


def shape_args(cfg: ViTConfig) -> dict[str, Any]:
    """The model_args every timm ViT entry point takes for the input and the transformer's shape."""
    return {"img_size": list(cfg.image_size), "patch_size": cfg.patch_size, "in_chans": cfg.in_channels,
            "embed_dim": cfg.hidden_size, "depth": cfg.depth, "num_heads": cfg.num_heads}  # fmt: skip


def hub_config(
    cfg: ViTConfig,
    arch: str,
    num_classes: int,
    pool: str,
    args: dict[str, Any],
    pre: Preprocess,
    meta: CheckpointMeta | None,
) -> dict[str, Any]:
    """timm's hub ``config.json``: ``timm.create_model(arch, **args)`` rebuilds the model; preprocessing and labels."""
    doc: dict[str, Any] = {
        "architecture": arch,
        "num_classes": num_classes,
        "num_features": cfg.hidden_size,
        "global_pool": pool,
        "model_args": args,
        "pretrained_cfg": pretrained_cfg(cfg, pre, num_classes),
    }
    if meta and meta.class_names:
        doc["label_names"] = list(meta.class_names)
    return doc


def pretrained_cfg(cfg: ViTConfig, pre: Preprocess, num_classes: int) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` (input size, interpolation, mean/std, crop) of ``pre``."""
    return {
        "input_size": [cfg.in_channels, *pre.image_size],
        "interpolation": pre.interpolation,
        "mean": list(pre.mean),
        "std": list(pre.std),
        "crop_pct": 1.0 if pre.resize == "squash" else pre.crop_pct,
        "crop_mode": "squash" if pre.resize in ("squash", "squash_crop") else "center",  # "shortest": center
        "num_classes": num_classes,
    }


def mlp_ratio(hidden: int, dim: int) -> float:
    """The smallest mlp_ratio r with int(dim * r) == hidden (timm's Block rounds the width down)."""
    r = hidden / dim
    while int(dim * r) < hidden:
        r = math.nextafter(r, math.inf)
    return r


def _no_embed_class(cfg: ViTConfig) -> bool:
    """timm's layout for this model: registers never have position slots in timm's DINOv2 (no_embed_class);
    otherwise the slots vitkit's position embedding has."""
    return cfg.num_prefix_tokens > 0 and (cfg.num_registers > 0 or cfg.num_pos_prefix == 0)


def _fold_slots(cfg: ViTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Written as no_embed_class: the class/distillation slots of the position embedding are added to their
    tokens (the same sums vitkit's forward computes) and zeroed."""
    slots = cfg.num_pos_prefix
    if not (_no_embed_class(cfg) and slots):
        return state
    state = dict(state)
    pe = state["pos_embed"].clone()
    for i, name in enumerate(["cls_token", "dist_token"][:slots]):
        state[name] = state[name] + pe[:, i : i + 1]
    pe[:, :slots] = 0
    state["pos_embed"] = pe
    return state


def _recoverable_from_shapes(cfg: ViTConfig) -> bool:
    """Whether a bare state dict (no config) reads back as exactly this model."""
    heads = HEADS_BY_WIDTH.get(cfg.hidden_size) or max(cfg.hidden_size // 64, 1)
    square = cfg.grid_size[0] == cfg.grid_size[1]
    plain = cfg.mlp == "plain" and cfg.classifier != "map" and not (cfg.norm_pre or cfg.distilled or cfg.num_registers)
    unscaled = cfg.layer_scale is None and not cfg.projection_size
    return (
        cfg.num_heads == heads and cfg.gelu == "exact" and cfg.layer_norm_eps == 1e-6 and square and plain and unscaled
    )


def _check_representable(cfg: ViTConfig, target: str) -> None:
    require(cfg.resnet_layers is None, target, "hybrid stems use timm's ResNetV2 with different StdConv eps")
    require(not cfg.representation_size, target, "current timm ViTs have no pre-logits layer")
    require_unseen(cfg, target)  # timm's VisionTransformer: no RoPE; fc_norm is not written yet
    require(cfg.key_bias, target, "timm's VisionTransformer has no qkv bias without the key's")
    require(
        cfg.patch_bias != cfg.norm_pre, target, "timm's patch embedding has a bias exactly when there is no pre-norm"
    )
    require(not (cfg.distilled and cfg.num_registers), target, "timm's DeiT has no register tokens")
    require(cfg.layer_scale != 0, target, "timm builds no layer scale for init_values=0")
    require(
        not (cfg.mlp == "swiglu" and cfg.classifier == "map"), target, "timm's MAP head after SwiGLU blocks differs"
    )
    require(not (cfg.projection_size and cfg.num_classes), target, "timm's CLIP towers hold the projection as the head")


def check_output(out: Path, overwrite: bool) -> None:
    """May :func:`save` write ``out``: a ``.safetensors``/``.pth`` file (an existing one only with ``overwrite``), or
    else a folder (only a checkpoint folder vitkit wrote, and that only with ``overwrite``)."""
    if out.suffix in SUFFIXES:
        check_output_file(out, overwrite=overwrite)
    else:
        torch_files.check_folder_output(out, overwrite)


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write a timm state dict: ``.safetensors``/``.pth`` file, or a hub folder (with config.json) otherwise.

    Files are written atomically; an existing file or vitkit-written folder is replaced only with ``overwrite``.
    """
    out = Path(path)
    check_output(out, overwrite)
    cfg = model.cfg
    _check_representable(cfg, "a timm state dict")
    cfg, state = with_learned_posemb(cfg, export_state(model))
    arrays = from_state_dict(key_map(cfg, no_embed_class=_no_embed_class(cfg)), _fold_slots(cfg, state))
    tensors = torch_files.from_arrays(arrays)
    if out.suffix in torch_files.PICKLE_SUFFIXES:
        require(
            _recoverable_from_shapes(cfg),
            f"{out.name}",
            f"a bare .pth cannot record heads={cfg.num_heads}, gelu={cfg.gelu}, eps={cfg.layer_norm_eps}, a "
            "non-square grid or the newer families' options; write a .safetensors file or a folder (both carry "
            "timm's config)",
        )
        return write_file_atomic(out, lambda tmp: torch.save(tensors, tmp))
    return write_with_config(out, tensors, timm_config(cfg, meta), overwrite)


def write_with_config(out: Path, tensors: dict[str, torch.Tensor], doc: dict[str, Any], overwrite: bool) -> Path:
    """timm's tensors with its config ``doc``: a ``.safetensors`` file (the config in its metadata) or a hub folder."""
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        metadata = {"format": "pt", META_KEY: json.dumps(doc), WRITER_KEY: WRITER}
        return write_file_atomic(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    files = {"config.json": json.dumps(doc, indent=2) + "\n"}
    return torch_files.write_folder(out, tensors, files, overwrite=overwrite)
