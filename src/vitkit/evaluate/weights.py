"""Which weights to evaluate: a checkpoint as saved, or a training run's EMA / raw weights.

A run folder written by ``vitkit train`` holds ``model/`` -- the final weights, which *are* the EMA
(Polyak) averages when the run used EMA -- and ``checkpoints/step-*/`` with both the raw parameters
(``model/<name>``) and their EMA averages (``ema/<name>``). ``weights`` picks:

- ``"default"``: the checkpoint as saved (for a run: ``model/``, i.e. EMA when EMA was on);
- ``"ema"``: the EMA averages of the run's latest checkpoint (an error when the run had no EMA);
- ``"raw"``: the non-averaged parameters of the run's latest checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.checkpoints.train_state import latest_state, read_state
from vitkit.errors import CheckpointError, ConfigError

WEIGHTS = ("default", "ema", "raw")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _strip(name: str) -> str:
    while name.startswith(_WRAPPER_PREFIXES):  # each prefix ends at its one dot
        name = name.split(".", 1)[1]
    return name


def run_weights(run_dir: str | os.PathLike[str], which: str) -> tuple[dict[str, torch.Tensor], int]:
    """(state dict, step) of the ``"ema"`` or ``"raw"`` weights in a run's latest training checkpoint."""
    root = Path(run_dir)
    ckpt = latest_state(root / "checkpoints")
    if ckpt is None:
        raise CheckpointError(
            f"{root}: not a training run with checkpoints; EMA and raw weights are only kept in run folders"
        )
    tensors, meta = read_state(ckpt)
    prefix = "ema/" if which == "ema" else "model/"
    state = {_strip(k[len(prefix) :]): v for k, v in tensors.items() if k.startswith(prefix)}
    if not state:
        what = "EMA weights (the run was trained without EMA)" if which == "ema" else "model weights"
        raise CheckpointError(f"{ckpt}: no {what}")
    return state, int(meta["step"])


def load_for_eval(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    weights: str = "default",
    image_size: int | tuple[int, int] | None = None,
) -> tuple[Loaded, str | None]:
    """Load a checkpoint for evaluation with the chosen weights; returns (loaded, note on what was used)."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "default":
        return load_checkpoint(path, format=format, image_size=image_size), None
    state, step = run_weights(path, weights)
    loaded = load_checkpoint(path, format=format)
    model = loaded.model
    missing = sorted(set(model.state_dict()) - set(state))
    extra = sorted(set(state) - set(model.state_dict()))
    if missing or extra:
        bad = (missing or extra)[0]
        raise CheckpointError(f"{path}: the run's {weights} weights do not match its model ({bad!r})")
    model.load_state_dict(state, strict=True)
    meta = loaded.meta
    if image_size is not None:
        model.resize_image(image_size)
        meta = replace(meta, preprocess=replace(meta.preprocess, image_size=model.cfg.image_size))
    kind = "EMA" if weights == "ema" else "raw (non-averaged)"
    return Loaded(model.eval(), meta), f"{kind} weights of training step {step}"
