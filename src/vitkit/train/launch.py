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
PRETRAIN_RESOLUTION = 224  # the paper pre-trains at 224 px; fine-tuning recipes' sizes are relative to it


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
    changes.update(shortened_warmup(cfg, epochs, steps))
    changes.update(parse_sets(sets))
    return cfg.override(**changes)


def shortened_warmup(cfg: TrainConfig, epochs: float | None, steps: int | None) -> dict[str, Any]:
    """The warm-up overrides for a run whose length ``--epochs`` / ``--steps`` replace: a recipe's warm-up is
    sized for its own length, so a shorter run keeps the same fraction of warm-up (a 15-step fine-tune of the
    500-step recipe warms up for 3 steps, not 100 -- its learning rate then decays as the recipe intends).
    A longer run keeps the recipe's warm-up. When the lengths are in different units and the warm-up is in the
    recipe's other unit (10k steps in a 90-epoch recipe, run for 100 steps), the proportion needs the epoch
    length, known only when the data is opened: the trainer then says so if warm-up fills the run."""
    o = cfg.optim
    if not (o.warmup_steps or o.warmup_epochs) or (epochs is None and steps is None):
        return {}
    new_unit, new = ("steps", float(steps)) if steps is not None else ("epochs", float(epochs or 0))
    old_unit, old = ("steps", cfg.steps) if cfg.steps is not None else ("epochs", cfg.epochs)
    if not old or old <= 0 or new <= 0:
        return {}
    if new_unit == old_unit:
        f = new / old
        if f >= 1:
            return {}
        return {"optim.warmup_steps": round(o.warmup_steps * f), "optim.warmup_epochs": o.warmup_epochs * f}
    if old_unit == "epochs" and o.warmup_steps == 0:  # warm-up in epochs of an epoch recipe, run in steps
        return {"optim.warmup_steps": round(o.warmup_epochs / old * new), "optim.warmup_epochs": 0.0}
    if old_unit == "steps" and o.warmup_epochs == 0:  # warm-up in steps of a step recipe, run in epochs
        return {"optim.warmup_steps": 0, "optim.warmup_epochs": o.warmup_steps / old * new}
    return {}


def train_config(recipe: str = "digits", **options: Any) -> TrainConfig:
    """``vitkit train``: a recipe (default: digits) with overrides."""
    return apply_options(get_recipe(recipe), **options)


def finetune_config(
    checkpoint: str, data: str, recipe: str = "paper-finetune", *, notes: list[str] | None = None, **options: Any
) -> TrainConfig:
    """``vitkit finetune``: a fine-tuning recipe starting from ``checkpoint`` on ``data``.

    Without an image size: the recipe's resolution relative to the paper's 224 px pre-training (384 px for
    ``paper-finetune``: x 384/224), applied to the checkpoint's own resolution and rounded to its stride --
    224 -> 384 px for a paper checkpoint, 16 -> 28 px for the digits model (384 px would be 9,216 tokens
    there) -- never above the larger of the checkpoint's and the recipe's resolution. The choice is appended
    to ``notes`` (the CLI prints it).
    """
    from vitkit.checkpoints import read_checkpoint

    cfg = get_recipe(recipe)
    if not cfg.model.init_from and cfg.model.name is not None:
        raise ConfigError(f"recipe {recipe!r} trains from scratch; use a fine-tuning recipe (paper-finetune, ...)")
    if options.get("image_size") is None:
        ckpt_cfg = read_checkpoint(checkpoint).cfg
        size = finetune_image_size(ckpt_cfg.image_size, ckpt_cfg.stride, cfg.data.image_size)
        options["image_size"] = size
        if notes is not None:
            (h, w), (rh, rw) = ckpt_cfg.image_size, cfg.data.image_size
            notes.append(
                f"fine-tuning at {size[0]}x{size[1]} px: the checkpoint's {h}x{w} px scaled as recipe {recipe} "
                f"scales the paper's {PRETRAIN_RESOLUTION} px ({rh}x{rw}); --image-size to choose"
            )
    cfg = cfg.override(**{"model.init_from": checkpoint, "data.source": data})
    return apply_options(cfg, **options)


def finetune_image_size(native: tuple[int, int], stride: int, recipe_size: tuple[int, int]) -> tuple[int, int]:
    """The default fine-tuning resolution for a checkpoint trained at ``native`` (see :func:`finetune_config`)."""
    # one scale for both sides (the aspect ratio is kept): the recipe's over 224 px, capped per side
    scale = min(min(t / PRETRAIN_RESOLUTION, max(n, t) / n) for n, t in zip(native, recipe_size, strict=True))
    h, w = (max(1, round(n * scale / stride)) * stride for n in native)
    return h, w


def resume_config(path: str | Path) -> tuple[TrainConfig, Path, Path]:
    """(config, run folder, checkpoint) for ``--resume PATH`` (a run folder or one checkpoint)."""
    checkpoint = train_state.resolve_resume(path)
    meta = train_state.read_state_meta(checkpoint)
    run_dir = checkpoint.parent.parent
    check_config_unchanged(run_dir / "config.json", meta["config"])
    return TrainConfig.from_dict(meta["config"]), run_dir, checkpoint


def check_config_unchanged(path: Path, saved: dict[str, Any]) -> None:
    """Refuse to resume when the run's ``config.json`` no longer says what its checkpoint was trained with:
    ``--resume`` continues exactly as configured, so an edit there would be ignored silently otherwise."""
    if not path.is_file():
        return
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); --resume needs the run's config as it was written") from None
    diffs = _differences(saved, doc, "")
    if diffs:
        shown = "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")
        raise ConfigError(
            f"{path}: edited since its checkpoint was written ({shown}); --resume continues a run exactly as it "
            "was configured: undo the edit, or start a new run with the new settings"
        )


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
