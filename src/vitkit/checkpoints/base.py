"""What every checkpoint format produces: a config, a state dict in vitkit's layout, and metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vitkit.data.preprocess import Preprocess
from vitkit.models.vit import VisionTransformer, ViTConfig


@dataclass
class CheckpointMeta:
    """Everything about a checkpoint that is not weights."""

    format: str  # "vitkit", "official", ...
    source: str  # the path it was read from
    preprocess: Preprocess
    class_names: list[str] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A foreign checkpoint converted to vitkit's state-dict layout (not yet in a model)."""

    cfg: ViTConfig
    state: dict[str, torch.Tensor]
    meta: CheckpointMeta


@dataclass
class Loaded:
    """A ready model plus its metadata (what ``load_checkpoint`` returns)."""

    model: VisionTransformer
    meta: CheckpointMeta

    def label(self, index: int) -> str:
        names = self.meta.class_names
        return names[index] if names and index < len(names) else f"class {index}"


def empty_model(cfg: ViTConfig) -> VisionTransformer:
    """A model with uninitialised storage (no random init): for loading weights into."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def expected_state(cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """The state dict a model with ``cfg`` expects, as meta tensors (shapes and dtypes, no memory)."""
    with torch.device("meta"):
        return VisionTransformer(cfg).state_dict()
