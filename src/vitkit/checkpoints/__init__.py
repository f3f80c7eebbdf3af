"""Checkpoint formats: one declarative, shape-checked key map per foreign layout.

``load_checkpoint(path)`` detects the format from the file's structure (or takes ``format=``), converts
it to vitkit's layout, builds the model and returns it with its metadata (preprocessing, class names).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from vitkit.checkpoints import native, official
from vitkit.checkpoints.base import Checkpoint, CheckpointMeta, Loaded, empty_model, expected_state
from vitkit.errors import CheckpointError, ConfigError
from vitkit.models.vit import VisionTransformer


@dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it and how to read it into vitkit's layout."""

    name: str
    description: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], Checkpoint]


def _is_official(path: Path) -> bool:
    if path.suffix != ".npz" or not path.is_file():
        return False
    try:
        import numpy as np

        with np.load(path, allow_pickle=False) as z:
            return official.looks_like(list(z.files))
    except (OSError, ValueError):
        return False


def _is_run(path: Path) -> bool:
    return path.is_dir() and not native.looks_like(path) and native.looks_like(path / "model")


def _load_run(path: Path) -> Checkpoint:
    return native.load(path / "model")


FORMATS: dict[str, Format] = {
    "vitkit": Format("vitkit", "vitkit folder: model.safetensors + config.json", native.looks_like, native.load),
    "run": Format("run", "vitkit training run folder (its model/ subfolder)", _is_run, _load_run),
    "official": Format(
        "official", "Google ViT/AugReg .npz (vit_jax layout, pre-Linen names)", _is_official, official.load
    ),
}


def detect_format(path: str | os.PathLike[str]) -> str:
    """Name of the format of the checkpoint at ``path``, judged from its structure."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    for fmt in FORMATS.values():
        if fmt.detect(p):
            return fmt.name
    raise CheckpointError(
        f"{p}: not a checkpoint in any known format ({', '.join(FORMATS)}); "
        "name the format (--format / format=) to force one"
    )


def read_checkpoint(path: str | os.PathLike[str], format: str | None = None) -> Checkpoint:
    """The checkpoint converted to vitkit's state-dict layout, not yet placed in a model."""
    p = Path(path)
    name = format or detect_format(p)
    if name not in FORMATS:
        raise ConfigError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    return FORMATS[name].load(p)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    pos_interpolation: str = "bilinear",
) -> Loaded:
    """Load any supported checkpoint as a ready model plus metadata.

    ``num_classes``: replace the head by a zero-initialised one for this many classes (dropping the
    pre-logits layer) when it differs from the checkpoint's. ``image_size``: change the resolution,
    resampling the position-embedding grid (``"bilinear"`` reproduces the official ``interpolate_posembed``
    exactly, ``"bicubic"`` is timm's choice).
    """
    ckpt = read_checkpoint(path, format)
    model = empty_model(ckpt.cfg)
    model.load_state_dict(ckpt.state, strict=True)
    meta = ckpt.meta
    if num_classes is not None and num_classes != ckpt.cfg.num_classes:
        model.reset_head(num_classes)
        meta = replace(meta, class_names=None)
    if image_size is not None:
        model.resize_image(image_size, method=pos_interpolation)
        meta = replace(meta, preprocess=replace(meta.preprocess, image_size=model.cfg.image_size))
    return Loaded(model.eval(), meta)


def load_pretrained(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
) -> VisionTransformer:
    """Load any supported checkpoint as a ViT (in eval mode); see :func:`load_checkpoint`."""
    return load_checkpoint(path, format=format, num_classes=num_classes, image_size=image_size).model


__all__ = [
    "FORMATS",
    "Checkpoint",
    "CheckpointMeta",
    "Format",
    "Loaded",
    "detect_format",
    "empty_model",
    "expected_state",
    "load_checkpoint",
    "load_pretrained",
    "read_checkpoint",
]
