"""The ``hf`` checkpoint format: a transformers folder of any model type vitkit reads, dispatched on config.json's
``model_type`` to the module that reads and writes that family's layout -- ``vit`` (:mod:`vitkit.checkpoints.hf`),
``dinov3_vit`` (:mod:`vitkit.checkpoints.hf_dinov3`), ``dinov2``/``dinov2_with_registers``/``deit``
(:mod:`vitkit.checkpoints.hf_dino`), ``clip_vision_model``/``clip``/``siglip_vision_model``/``siglip``
(:mod:`vitkit.checkpoints.hf_clip`). A model is written by the first family that claims its config (DINOv3's RoPE:
DINOv3; layer scale, registers or SwiGLU: DINOv2; distilled: DeiT; CLIP's and SigLIP's options), else as a plain
ViT folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from vitkit.checkpoints import hf, hf_clip, hf_dino, hf_dinov3, torch_files
from vitkit.checkpoints.hf import CONFIG, Family
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer


def families() -> dict[str, Family]:
    """model_type -> its :class:`~vitkit.checkpoints.hf.Family`, besides ``vit``."""
    return {**hf_dinov3.FAMILIES, **hf_dino.FAMILIES, **hf_clip.FAMILIES}  # DINOv3 claims before DINOv2


def looks_like(path: Path) -> bool:
    """A folder whose config.json names ``vit`` or one of :func:`families` as its ``model_type``."""
    model_type = torch_files.folder_config(path).get("model_type")
    return isinstance(model_type, str) and (model_type == "vit" or model_type in families())


def load(path: Path) -> Checkpoint:
    """Read a transformers folder through its family's module; an unknown model_type is one line."""
    doc = hf._read_json(path / CONFIG)
    model_type = doc.get("model_type", "vit")
    if model_type == "vit":
        return hf.load(path)
    known = families()
    if not isinstance(model_type, str) or model_type not in known:
        raise CheckpointError(f"{path / CONFIG}: model_type {model_type!r} is not supported (known: vit, "
                              f"{', '.join(known)})")  # fmt: skip
    return known[model_type].load(path, doc)


def save(
    model: VisionTransformer,
    path: str | os.PathLike[str],
    meta: CheckpointMeta | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as the transformers folder of the first family that claims it, else as a ViT folder."""
    family = next((f for f in families().values() if f.claims(model.cfg)), None)
    if family is not None:
        return family.save(model, Path(path), meta, overwrite)
    return hf.save(model, Path(path), meta, overwrite=overwrite)
