"""From command-line style options to a finished run: recipe + overrides -> config -> Trainer.

The CLI (``vitkit train`` / ``vitkit finetune``) is a thin layer over these functions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitkit.configs import TrainConfig, get_recipe
from vitkit.errors import ConfigError
from vitkit.train import state as train_state
from vitkit.train.trainer import Trainer, TrainResult

ARCHITECTURE_FIELDS = ("patch_size", "hidden_size", "depth", "num_heads", "mlp_dim")
FINETUNE_RESOLUTION = 384  # the paper fine-tunes at 384 px (rounded to a multiple of the patch size)


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """["optim.lr=3e-3", "aug.augreg=medium1"] -> {"optim.lr": 0.003, "aug.augreg": "medium1"} (JSON values,
    anything else as a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(text)
        except ValueError:
            out[key.strip()] = text
    return out


def apply_options(
    cfg: TrainConfig,
    *,
    data: str | None = None,
    model: str | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    image_size: tuple[int, int] | None = None,
    seed: int | None = None,
    compile: bool | None = None,
    precision: str | None = None,
    workers: int | None = None,
    skip_bad: bool | None = None,
    skip_nonfinite: bool | None = None,
    sets: Sequence[str] = (),
) -> TrainConfig:
    """The recipe's config with the CLI's few overrides, then any ``--set KEY=VALUE``."""
    changes: dict[str, Any] = {}
    if data is not None:
        changes["data.source"] = data
    if model is not None:  # a named variant replaces the recipe's architecture (regularisation stays)
        changes["model.name"] = model
        changes["model.overrides"] = {k: v for k, v in cfg.model.overrides.items() if k not in ARCHITECTURE_FIELDS}
    if epochs is not None:
        changes["epochs"], changes["steps"] = epochs, None
    if steps is not None:
        changes["steps"] = steps
    simple = {
        "data.batch_size": batch_size,
        "optim.lr": lr,
        "data.image_size": image_size,
        "seed": seed,
        "compile": compile,
        "precision": precision,
        "data.workers": workers,
        "data.skip_bad": skip_bad,
        "skip_nonfinite": skip_nonfinite,
    }
    changes.update({k: v for k, v in simple.items() if v is not None})
    changes.update(parse_sets(sets))
    return cfg.override(**changes)


def train_config(recipe: str = "digits", **options: Any) -> TrainConfig:
    """``vitkit train``: a recipe (default: digits) with overrides."""
    return apply_options(get_recipe(recipe), **options)


def finetune_config(checkpoint: str, data: str, recipe: str = "paper-finetune", **options: Any) -> TrainConfig:
    """``vitkit finetune``: a fine-tuning recipe starting from ``checkpoint`` on ``data``.

    Without an image size, the paper's 384 px (rounded to a multiple of the checkpoint's patch size).
    """
    from vitkit.checkpoints import read_checkpoint

    cfg = get_recipe(recipe)
    if not cfg.model.init_from and cfg.model.name is not None:
        raise ConfigError(f"recipe {recipe!r} trains from scratch; use a fine-tuning recipe (paper-finetune, ...)")
    if options.get("image_size") is None:
        patch = read_checkpoint(checkpoint).cfg.patch_size
        side = max(1, round(FINETUNE_RESOLUTION / patch)) * patch
        options["image_size"] = (side, side)
    cfg = cfg.override(**{"model.init_from": checkpoint, "data.source": data})
    return apply_options(cfg, **options)


def resume_config(path: str | Path) -> tuple[TrainConfig, Path, Path]:
    """(config, run folder, checkpoint) for ``--resume PATH`` (a run folder or one checkpoint)."""
    checkpoint = train_state.resolve_resume(path)
    meta = train_state.read_state_meta(checkpoint)
    return TrainConfig.from_dict(meta["config"]), checkpoint.parent.parent, checkpoint


def run(
    cfg: TrainConfig | None,
    out: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``cfg`` into ``out`` (default ``runs/<name>``, numbered when taken), or resume a run."""
    if resume is not None:
        cfg, run_dir, checkpoint = resume_config(resume)
        trainer = Trainer(cfg, run_dir, progress=progress, claim=False)
    else:
        if cfg is None:
            raise ConfigError("nothing to run: give a config or a run to resume")
        base = Path(out) if out is not None else Path("runs") / cfg.name
        trainer = Trainer(cfg, base, progress=progress, claim="numbered" if out is None else "exclusive")
        checkpoint = None
    with trainer:
        return trainer.fit(checkpoint)


def summary(result: TrainResult) -> str:
    """The lines ``vitkit train`` prints at the end."""
    lines = []
    if result.final_top1 is not None:
        n = int(result.final_metrics.get("val_count", 0))
        correct = round(result.final_top1 * n)
        lines.append(f"{result.val_split} accuracy: {100 * result.final_top1:.2f}% ({correct}/{n})")
    if result.skipped_steps:
        lines.append(f"skipped {result.skipped_steps} steps with a non-finite loss or gradient")
    lines.append(f"run folder: {result.run_dir} ({result.step} steps, {result.seconds:.1f} s)")
    return "\n".join(lines)
