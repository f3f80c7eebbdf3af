"""``vitkit train`` and ``vitkit finetune``: a recipe, a few named options and ``--set``, then a run.

``OPTIONS`` is the one table from flag to config field: argparse reads it to build the flags, and the
values go to :func:`vitkit.configs.apply_overrides` under their field names.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vitkit.commands.args import image_size, nonnegative_int, note_emulated_bf16, positive_float, positive_int
from vitkit.configs import TrainConfig
from vitkit.errors import VitkitError

# flag, the config field it sets, argparse keywords (store_true flags default to None: "not given")
OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--epochs", "epochs", {"type": positive_float, "help": "training length in epochs (replaces the recipe's)"}),
    ("--steps", "steps", {"type": positive_int, "help": "training length in optimiser steps (wins over epochs)"}),
    ("--batch-size", "data.batch_size", {"type": positive_int,
     "help": "global batch size (all processes, accumulation)"}),
    ("--lr", "optim.lr", {"type": positive_float, "help": "base learning rate"}),
    ("--image-size", "data.image_size", {"type": image_size, "help": "training resolution, e.g. 384 or 224x320"}),
    ("--seed", "seed", {"type": nonnegative_int, "help": "seed for initialisation, data order, augmentation, dropout"}),
    ("--workers", "data.workers", {"type": nonnegative_int, "help": "data-loading worker processes per process"}),
    ("--precision", "precision", {"choices": ["fp32", "bf16", "auto"],
                                  "help": "bf16: autocast with fp32 master weights; auto: bf16 on a GPU with bf16, "
                                  "else fp32"}),
    ("--compile", "compile", {"action": "store_true", "default": None, "help": "torch.compile the model"}),
    ("--grad-checkpointing", "grad_checkpointing", {"action": "store_true", "default": None,
     "help": "activation checkpointing: recompute block activations in the backward pass (less memory)"}),
    ("--skip-bad", "data.skip_bad", {"action": "store_true", "default": None,
     "help": "skip unreadable images (counted)"}),
    ("--skip-nonfinite", "skip_nonfinite", {"action": "store_true", "default": None,
     "help": "skip (and count) steps whose loss is NaN/inf"}),
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_train(sub)
    _add_finetune(sub)


def _add_options(p: argparse.ArgumentParser) -> None:
    """The few overrides shared by train and finetune; recipes carry everything else."""
    for flag, field, kwargs in OPTIONS:
        p.add_argument(flag, dest=field, **kwargs)
    p.add_argument("--out", help="run folder (default runs/<recipe name>, numbered when taken)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config field, checked against its type, e.g. --set optim.weight_decay=0.1 --set aug.augreg=medium1 "
        "--set model.overrides.drop_path=0.1",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    """The named options given, by config field."""
    fields = [field for _, field, _ in OPTIONS] + ["data.source", "model.name"]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def _add_train(sub: argparse._SubParsersAction) -> None:
    from vitkit.configs import RECIPES

    p = sub.add_parser(
        "train",
        help="train a ViT from scratch (default: the bundled 8x8 digits)",
        description="Train a ViT from a recipe. With no arguments: a small ViT on scikit-learn's bundled 8x8 "
        "digits, then the test accuracy. Writes runs/<name>/ (model/, checkpoints/, config.json, metrics.csv, "
        "curves.png). Multi-process: torchrun --nproc_per_node N -m vitkit train ...",
    )
    p.add_argument(
        "--recipe", choices=sorted(RECIPES), help="recipe (default: digits, which is sized for the bundled digits)"
    )
    p.add_argument(
        "--data", dest="data.source", help="dataset: digits, an ImageFolder root, a CIFAR folder, an .npz, shards"
    )
    p.add_argument("--model", dest="model.name", help="a variant such as S/16 (replaces the recipe's architecture)")
    p.add_argument("--resume", metavar="RUN", help="continue a run (its folder or a checkpoint) exactly")
    _add_options(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from vitkit.configs import apply_overrides, get_recipe
    from vitkit.train import train

    flags = {field: flag for flag, field, _ in OPTIONS} | {"data.source": "--data", "model.name": "--model"}
    if args.resume:
        given = [flags[f] for f in _changes(args)] + (["--set"] if args.sets else [])
        given += ["--out"] if args.out is not None else []
        if given or args.recipe is not None:
            raise VitkitError(
                f"--resume continues a run with its saved config; drop {', '.join(given or ['--recipe'])}"
            )
        result = train(resume=args.resume, progress=not args.quiet)
    else:
        data = getattr(args, "data.source")
        if args.recipe is None and data not in (None, "digits"):
            raise VitkitError(
                f"--data {data}: the default recipe trains a 16 px greyscale ViT for the bundled 8x8 digits; "
                "choose a recipe for these images with --recipe (cifar-small, plain-vit-s16, deit-i1k, ...; "
                "--recipe digits to keep it)"
            )
        cfg = apply_overrides(get_recipe(args.recipe or "digits"), _changes(args), args.sets)
        _note_emulated_bf16(cfg)
        result = train(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(result.summary())
    return 0


def _note_emulated_bf16(cfg: TrainConfig) -> None:
    """Say so when bf16 autocast will run on a CPU that has no bf16 instructions (PyTorch emulates it)."""
    if cfg.precision == "bf16":
        note_emulated_bf16(cfg.device, "--precision fp32 is the fast choice here")


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    from vitkit.configs import RECIPES

    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on your images (new zero head, higher resolution)",
        description="Fine-tune any supported checkpoint: the head (and pre-logits) is replaced by a zero-initialised "
        "one for the dataset's classes, the position embeddings are interpolated to the new resolution (default "
        "384 px), and the paper's SGD recipe runs (momentum 0.9, cosine, no weight decay, clip 1). "
        "Resume with: vitkit train --resume RUN.",
    )
    p.add_argument("checkpoint", help="checkpoint to start from (any supported format, or a run folder)")
    p.add_argument(
        "--data", dest="data.source", required=True, help="dataset: an ImageFolder root, CIFAR folder, .npz, digits"
    )
    fine = sorted(k for k in RECIPES if "finetune" in k)
    p.add_argument("--recipe", default="paper-finetune", choices=fine, help="recipe (default: paper-finetune)")
    _add_options(p)
    p.set_defaults(func=cmd_finetune)


def cmd_finetune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.configs import apply_overrides, finetune_config, get_recipe
    from vitkit.train import check_run_dir, train

    # the run folder before the checkpoint is read (train() checks it again when it claims it)
    if args.out is not None:
        check_run_dir(Path(args.out))
    else:  # runs/<name>, numbered when taken
        check_run_dir(Path("runs") / get_recipe(args.recipe).name, numbered=True)
    notes: list[str] = []
    base = finetune_config(
        args.checkpoint, getattr(args, "data.source"), args.recipe, getattr(args, "data.image_size"), notes=notes
    )
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    cfg = apply_overrides(base, _changes(args), args.sets)
    _note_emulated_bf16(cfg)
    result = train(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(result.summary())
    return 0
