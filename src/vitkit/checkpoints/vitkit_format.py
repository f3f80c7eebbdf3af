"""vitkit's own format: a folder with ``model.safetensors`` and ``config.json``.

``config.json`` holds the model config, the preprocessing, class names and provenance::

    {"format": "vitkit", "version": 1, "model": {...}, "preprocess": {...},
     "class_names": [...] | null, "provenance": {...}}

Weights are plain safetensors (no pickle anywhere). Writes are atomic: files go to a temporary folder
that replaces the target by renames, so a crash never leaves a half-written model behind. An existing
folder is replaced only when vitkit wrote it (a checkpoint folder in any format vitkit writes: vitkit, hf,
timm) and ``overwrite=True``; anything else is refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, check_fits_file, check_preprocess, export_state
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig
from vitkit.textids import printable

FORMAT = "vitkit"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


# The fields that decide the tensors' shapes or the function computed: a vitkit config.json always holds them,
# and one that lacks any is refused rather than filled with defaults (a different model, silently).
REQUIRED_MODEL_FIELDS = (
    "image_size", "patch_size", "in_channels", "num_classes", "hidden_size", "depth", "num_heads", "mlp_dim",
    "classifier", "pos_embed", "representation_size", "gelu", "layer_norm_eps", "qkv_bias", "resnet_layers",
)  # fmt: skip


def looks_like(path: Path) -> bool:
    """A folder whose ``config.json``, a regular file, says it is vitkit's."""
    return torch_files.folder_config(path).get("format") == FORMAT


def load(path: Path) -> Checkpoint:
    cfg_path, w_path = path / CONFIG, path / WEIGHTS
    try:
        meta = json.loads(cfg_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
            raise CheckpointError(f'{cfg_path}: invalid vitkit config (no "model" object)')
        missing = [k for k in REQUIRED_MODEL_FIELDS if k not in meta["model"]]
        if missing:
            raise CheckpointError(
                f"{cfg_path}: the model config lacks {', '.join(missing)} (vitkit writes every field)"
            )
        cfg = ViTConfig.from_dict(meta["model"])
        preprocess = Preprocess.from_dict(meta.get("preprocess") or {"image_size": cfg.image_size})
        check_preprocess(cfg, preprocess, str(cfg_path))
        names = meta.get("class_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f'{cfg_path}: invalid vitkit config ("class_names" must be a list of strings)')
        if not isinstance(meta.get("provenance") or {}, dict):
            raise CheckpointError(f'{cfg_path}: invalid vitkit config ("provenance" must be an object)')
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: no such file") from None
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        # the message may quote the file's own strings (an unknown key "\n"): printable keeps it one line
        raise CheckpointError(f"{cfg_path}: invalid vitkit config ({type(e).__name__}: {printable(str(e))})") from None
    if not w_path.is_file():
        raise CheckpointError(f"{w_path}: no such file")
    numel = sum(math.prod(shape) for shape in torch_files.safetensors_shapes(w_path).values())
    check_fits_file(cfg, numel, str(path))
    state = torch_files.read_state_file(w_path)
    return Checkpoint(
        cfg,
        state,
        CheckpointMeta(
            format=FORMAT,
            source=str(path),
            preprocess=preprocess,
            class_names=meta.get("class_names"),
            provenance=meta.get("provenance") or {},
        ),
    )


def save(
    model: VisionTransformer,
    path: str | os.PathLike[str],
    *,
    preprocess: Preprocess | None = None,
    class_names: list[str] | None = None,
    provenance: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a vitkit folder, atomically.

    An existing non-empty folder is replaced only when it is a vitkit checkpoint (nothing else in it) and
    ``overwrite`` is true; any other folder is refused with a CheckpointError, and nothing is deleted.
    """
    out = Path(path)
    torch_files.check_folder_output(out, overwrite)
    if class_names is not None and len(class_names) != model.cfg.num_classes:
        raise CheckpointError(f"{len(class_names)} class names for a model with {model.cfg.num_classes} classes")
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": model.cfg.to_dict(),
        "preprocess": (preprocess or Preprocess(image_size=model.cfg.image_size)).to_dict(),
        "class_names": class_names,
        "provenance": provenance or {},
    }
    # (write_folder checks ``out`` again: the check above comes first, before the class names)
    return torch_files.write_folder(
        out, export_state(model), {CONFIG: json.dumps(doc, indent=2) + "\n"}, overwrite=overwrite
    )
