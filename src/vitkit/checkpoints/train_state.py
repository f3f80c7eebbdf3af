"""Reading a training run's saved states (``checkpoints/step-000001234/`` of a run folder: ``state.safetensors``
and ``state.json``, :mod:`vitkit.train.state` writes them): listing them, the latest, one read and validated.

Here, among the checkpoint formats, so that what reads a run's weights (``vitkit eval --weights ema``:
:mod:`vitkit.evaluate.weights`) and what resumes it (:mod:`vitkit.train.state`) read them one way, downward.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vitkit.errors import CheckpointError
from vitkit.fileio import complete_dir, temp_target

STATE_FORMAT = "vitkit-train-state"
STATE_VERSION = 1
TENSORS = "state.safetensors"
META = "state.json"
STEP_NAME = re.compile(r"^step-(\d{9})$")


def state_name(step: int) -> str:
    return f"step-{step:09d}"


def list_states(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    names = {temp_target(entry.name, "old") or entry.name for entry in root.iterdir()}
    for name in names:
        m = STEP_NAME.match(name)
        entry = complete_dir(root / name)  # a step being re-saved is read from its previous copy
        if m and is_complete(entry):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def is_complete(entry: Path) -> bool:
    return (entry / TENSORS).is_file() and (entry / META).is_file()


def latest_state(folder: str | os.PathLike[str]) -> Path | None:
    found = list_states(folder)
    return found[-1][1] if found else None


def read_state_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON half of a checkpoint (step, config ...), without loading tensors."""
    p = Path(path) / META
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p.parent}: not a training checkpoint (no {META})") from None
    except ValueError as e:
        raise CheckpointError(f"{p}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{p}: not a vitkit training state")
    return meta


def read_state(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta) of one checkpoint folder, validated."""
    p = Path(path)
    meta = read_state_meta(p)
    try:
        tensors = load_file(str(p / TENSORS))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{p / TENSORS}: unreadable ({e})") from None
    return tensors, meta
