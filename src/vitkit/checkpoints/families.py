"""The model each family registry entry (:mod:`vitkit.hub.families`) describes, and how the loader sees it.

``registry_config(entry)``: the :class:`ViTConfig` the entry declares (``vitkit_config``); ``loader_config``:
the one vitkit's own loader builds from the entry's transformers config (``hf_dino`` / ``hf_dinov3`` /
``hf_clip``), None for timm entries (whose loader reads shapes: the tests build timm's model to check those);
``param_count``: the parameters of vitkit's model for a config, counted on the meta device (no memory, no
initialisation).
"""

from __future__ import annotations

from typing import Any

import torch

from vitkit.checkpoints import hf_clip, hf_dino, hf_dinov3
from vitkit.hub.families import FamilyEntry
from vitkit.models.vit import VisionTransformer, ViTConfig


def registry_config(entry: FamilyEntry) -> ViTConfig:
    """The config ``entry.vitkit_config`` declares (JSON lists back to tuples)."""
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.vitkit_config.items()}
    return ViTConfig(**kwargs)


def loader_config(entry: FamilyEntry) -> ViTConfig | None:
    """The config vitkit's transformers loader reads from the entry's config.json fields; None for timm."""
    if entry.format != "hf":
        return None
    doc = entry.config
    model_type = str(doc.get("model_type"))
    if model_type in (hf_dino.DINO, hf_dino.DINO_REG):
        return hf_dino.dino_config(doc, model_type, entry.name)
    if model_type == hf_dinov3.MODEL_TYPE:
        return hf_dinov3.dinov3_config(doc, entry.name)
    if model_type == hf_dino.DEIT:
        return hf_dino.deit_config(doc, int(doc.get("num_labels") or len(doc.get("id2label") or {})), entry.name)
    family, _, vision = hf_clip.vision_doc(doc, entry.name)
    return hf_clip.config_from_hf(family, vision, entry.name)


def param_count(cfg: ViTConfig) -> int:
    """vitkit's parameter count for ``cfg``."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    return sum(p.numel() for p in model.parameters())


def config_fields(cfg: ViTConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that differ from ViTConfig's defaults, JSON-ready (for the registry's data); the class
    token whenever the classifier alone would not give it (a "gap" model with a class token: DINOv3 in timm)."""
    default = ViTConfig()
    out: dict[str, Any] = {}
    for name in ViTConfig.__dataclass_fields__:
        value = getattr(cfg, name)
        if name in ("extra", "name") or value == getattr(default, name):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    if cfg.class_token != ViTConfig(classifier=cfg.classifier).class_token:
        out["class_token"] = cfg.class_token
    return out
