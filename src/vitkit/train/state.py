"""Resumable training state: atomic, keep-last-k, no pickle.

A training state is a folder ``checkpoints/step-000001234/`` of the run holding

- ``state.safetensors``: every tensor -- ``model/<name>``, ``ema/<name>``, ``optim/<param name>/<key>``
  (Adam moments, step counts, SGD momentum), always full (unsharded) tensors;
- ``state.json``: everything else -- step, epoch, the optimiser's hyper-parameters, EMA update count,
  best metric, skipped-step count, class names, the resolved config.

Writing goes to a hidden temporary folder (files fsync'ed), which is renamed into place in one
``os.replace``; only then are old checkpoints pruned (renamed to a hidden name, then deleted). A crash at
any moment leaves either the new checkpoint complete or no trace of it, and the previous one untouched.
Reading states (listing, the latest, one validated) is :mod:`vitkit.checkpoints.train_state`'s, re-used here.
Hidden folders are never read, except ``.step-N.vitkit-old-...`` while the same step is being re-saved (see
``fileio.replace_dir``; the whole write is ``fileio.write_dir_atomic``). :func:`clean_states` removes what a
kill left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from vitkit.checkpoints.train_state import (  # the reading half, below: evaluate/weights.py reads runs too
    META,
    STATE_FORMAT,
    STATE_VERSION,
    STEP_NAME,
    TENSORS,
    is_complete,
    latest_state,
    list_states,
    read_state,
    read_state_meta,
    state_name,
)
from vitkit.configs import TrainConfig
from vitkit.errors import CheckpointError, ConfigError
from vitkit.fileio import clean_stale, refuse_link, remove_tree, write_dir_atomic
from vitkit.train import parallel as distr
from vitkit.train.ema import EMA

#: what a training state holds of a run: the bare model, its optimiser, the EMA (None: off), the processes
Trained = tuple[nn.Module, torch.optim.Optimizer, EMA | None, distr.DistInfo]


def clean_states(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what a kill left in a checkpoints folder: vitkit's hidden temporaries (an interrupted re-save
    is restored) and ``step-N`` folders that lack their files (a prune cut short). Returns notes."""
    root = Path(folder)
    done = clean_stale(root)
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if STEP_NAME.match(entry.name) and entry.is_dir() and not entry.is_symlink() and not is_complete(entry):
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"removed incomplete {entry.name}")
    return done


def write_state(
    folder: str | os.PathLike[str],
    step: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write one checkpoint atomically, then keep only the newest ``keep_last``."""
    root = Path(folder)
    final = root / state_name(step)

    def write(tmp: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / TENSORS))
        doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "step": step, **meta}
        (tmp / META).write_text(json.dumps(doc, indent=1) + "\n")

    write_dir_atomic(final, write)  # the same step saved again (after a resume) is swapped out first
    for _, path in list_states(root)[:-keep_last]:
        remove_tree(path)
    return final


def resolve_resume(path: str | os.PathLike[str]) -> Path:
    """A run folder, its checkpoints folder, or one checkpoint -> the checkpoint to resume from."""
    p = Path(path)
    if (p / META).is_file():
        return p
    for folder in (p / "checkpoints", p):
        ckpt = latest_state(folder)
        if ckpt is not None:
            return ckpt
    raise CheckpointError(f"{p}: no training checkpoint to resume from")


# ---- optimiser state <-> flat tensors + JSON ------------------------------------------------------------


def flatten_optimizer(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A name-keyed optimiser state dict (``get_optimizer_state_dict``) -> tensors and JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, field = key[len("optim/") :].rpartition("/")
            state.setdefault(name, {})[field] = value
    for name, extra in doc.get("scalars", {}).items():
        state.setdefault(name, {}).update(extra)
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in doc["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---- a run's model, optimiser and EMA <-> one training state ------------------------------------------------


def save_training(
    folder: Path,
    step: int,
    run: Trained,
    model_state: dict[str, torch.Tensor],
    best: dict[str, torch.Tensor],
    counters: dict[str, Any],
    classes: list[str],
    config: dict[str, Any],
    keep_last: int,
) -> None:
    """Write a run's training state: ``model_state`` (the full weights, gathered by the caller), the optimiser
    and the EMA weights of ``run`` (net, optimiser, EMA, processes), the selected weights ``best`` and the run's
    ``counters``. Every process takes part (the full tensors are gathered); process 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    net, opt, ema, dist = run
    osd = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    shadow = {k: distr.full_tensor(v).cpu() for k, v in ema.shadow.items()} if ema else {}
    if dist.is_main:
        opt_tensors, opt_doc = flatten_optimizer(osd)
        tensors = {f"model/{k}": v for k, v in model_state.items()}
        tensors.update(opt_tensors)
        tensors.update({f"ema/{k}": v for k, v in shadow.items()})
        tensors.update({f"best/{k}": v for k, v in best.items()})
        meta = {
            **counters,
            "ema_updates": ema.updates if ema else 0,
            "optimizer": opt_doc,
            "class_names": classes,
            "world_size": dist.world,
            "config": config,
        }
        write_state(folder, step, tensors, meta, keep_last)
    distr.barrier(dist)


def load_training(path: str | Path, run: Trained, classes: list[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore the model, optimiser and EMA of ``run`` from a state written by :func:`save_training`; returns
    its meta (the counters) and the selected weights it holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    net, opt, ema, dist = run
    tensors, meta = read_state(path)
    if meta.get("class_names") != classes:
        raise CheckpointError(f"{path}: the checkpoint's classes differ from the dataset's")
    opts = StateDictOptions(full_state_dict=True)
    model_sd: dict[str, Any] = {
        k[len("model/") :]: v.to(dist.device) for k, v in tensors.items() if k.startswith("model/")
    }
    try:
        set_model_state_dict(net, model_sd, options=opts)
        set_optimizer_state_dict(net, opt, unflatten_optimizer(tensors, meta["optimizer"]), options=opts)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: does not match this model/optimiser ({e})") from None
    if ema is not None:
        for name, shadow in ema.shadow.items():
            if f"ema/{name}" not in tensors:
                raise CheckpointError(f"{path}: no EMA weights for {name}")
            distr.load_full_into(shadow, tensors[f"ema/{name}"])
        ema.updates = int(meta["ema_updates"])
    return meta, {k[len("best/") :]: v for k, v in tensors.items() if k.startswith("best/")}


def resume_config(path: str | Path) -> tuple[TrainConfig, Path, Path | None]:
    """(config, run folder, training state) for resuming from ``path`` (a run folder or one state folder).

    A run stopped before its first training state (killed before it could remove what it wrote; a linear head
    has none) resumes from its ``config.json`` with no state: it starts again from step 0 in its folder, as
    configured (a linear or LP-FT head is fitted again, its features read from the feature cache where the
    stopped run stored them)."""
    try:
        state = resolve_resume(path)
    except CheckpointError:
        cfg = _unstarted_config(Path(path))
        if cfg is None:
            raise
        return cfg, Path(path), None
    saved = _older_defaults(read_state_meta(state)["config"])
    check_config_unchanged(state.parent.parent / "config.json", saved)
    return TrainConfig.from_dict(saved), state.parent.parent, state


def _older_defaults(config: Any) -> Any:
    """A run's config as the version that wrote it ran it: a run from before ``optim.warmup_max_fraction``
    existed had its warm-up exactly as given (null), and resumes so."""
    optim = config.get("optim") if isinstance(config, dict) else None
    if isinstance(optim, dict) and "warmup_max_fraction" not in optim:
        return {**config, "optim": {**optim, "warmup_max_fraction": None}}
    return config


def _unstarted_config(run: Path) -> TrainConfig | None:
    """The config of a run folder that holds a ``config.json`` and no training state, else None."""
    path = run / "config.json"
    refuse_link(path, "--resume")
    if list_states(run / "checkpoints") or not path.is_file():
        return None
    doc = _run_config(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a run's config (a JSON object); --resume needs the run's config as written")
    return TrainConfig.from_dict(_older_defaults(doc))


def check_config_unchanged(path: Path, saved: dict[str, Any]) -> None:
    """Refuse to resume when the run's ``config.json`` no longer says what its checkpoint was trained with:
    ``--resume`` continues exactly as configured, so an edit there would be ignored silently otherwise."""
    refuse_link(path, "--resume")  # a planted link is refused, neither read nor written through
    if not path.is_file():
        return
    diffs = _differences(saved, _older_defaults(_run_config(path)), "")
    if diffs:
        shown = "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")
        raise ConfigError(
            f"{path}: edited since its checkpoint was written ({shown}); --resume continues a run exactly as it "
            "was configured: undo the edit, or start a new run with the new settings"
        )


def _run_config(path: Path) -> Any:
    """A run's ``config.json``, as JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); --resume needs the run's config as it was written") from None


def _differences(old: Any, new: Any, where: str) -> list[str]:
    """'field: old -> new' for every leaf where two JSON documents differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            path = f"{where}.{k}" if where else str(k)
            if k not in new:
                out.append(f"{path}: removed")
            elif k not in old:
                out.append(f"{path}: added")
            else:
                out += _differences(old[k], new[k], path)
        return out
    return [] if old == new else [f"{where}: {json.dumps(old)} -> {json.dumps(new)}"]
