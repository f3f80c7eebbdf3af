"""``vitkit train`` and ``vitkit finetune``: a recipe, a few named options and ``--set``, then a run.

``OPTIONS`` is the one table from flag to config field: argparse reads it to build the flags, and the
values go to :func:`vitkit.configs.apply_overrides` under their field names.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from vitkit.commands.args import (
    image_size,
    nonnegative_int,
    note_emulated_bf16,
    positive_float,
    positive_int,
    print_notes,
    worker_count,
)
from vitkit.configs.recipes import RECIPES
from vitkit.configs.schema import ADAPT_METHODS
from vitkit.errors import VitkitError

if TYPE_CHECKING:
    from vitkit.configs import TrainConfig

# flag, the config field it sets, argparse keywords (store_true flags default to None: "not given")
OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--epochs", "epochs", {"type": positive_float, "help": "training length in epochs (replaces the recipe's)"}),
    ("--steps", "steps", {"type": positive_int, "help": "training length in optimiser steps (wins over epochs)"}),
    ("--batch-size", "data.batch_size", {"type": positive_int,
     "help": "global batch size (all processes, accumulation)"}),
    ("--lr", "optim.lr", {"type": positive_float, "help": "base learning rate"}),
    ("--image-size", "data.image_size", {"type": image_size, "help": "training resolution, e.g. 384 or 224x320"}),
    ("--seed", "seed", {"type": nonnegative_int, "help": "seed for initialisation, data order, augmentation, dropout"}),
    ("--workers", "data.workers", {"type": worker_count, "help": "data-loading worker processes per process"}),
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


# finetune's adaptation options: flag, config field, argparse keywords, the methods it applies to
ADAPT_OPTIONS: tuple[tuple[str, str, dict[str, Any], tuple[str, ...]], ...] = (
    ("--l2", "adapt.l2", {"type": lambda t: _l2(t), "metavar": "auto|L2",
     "help": "L2 strength of the linear head (mean cross-entropy + L2/2 ||W||^2; default auto: chosen on held-out "
     "training examples)"}, ("linear", "lp-ft")),
    ("--feature-epochs", "adapt.feature_epochs", {"type": nonnegative_int,
     "help": "extra feature passes through the training augmentation (light augmentation; default 0)"},
     ("linear", "lp-ft")),
    ("--feature-cache", "adapt.feature_cache", {"metavar": "DIR",
     "help": "feature cache folder (default: features/ in vitkit's cache directory)"}, ("linear", "lp-ft")),
    ("--feature-precision", "adapt.feature_precision", {"choices": ["fp32", "bf16", "int8"],
     "help": "fp32 (default): the features of the model as it is; bf16 or int8: through the fast inference path "
     "(vitkit bench says which is fastest on this CPU; features within about 1%% (bf16) or a few %% (int8) of "
     "fp32's)"}, ("linear", "lp-ft")),
    ("--lora-rank", "adapt.lora_rank", {"type": positive_int, "help": "adapter rank r (default 8)"}, ("lora",)),
    ("--lora-alpha", "adapt.lora_alpha", {"type": positive_float,
     "help": "adapter scale alpha: updates are scaled by alpha / r (default 16)"}, ("lora",)),
    ("--lora-dropout", "adapt.lora_dropout", {"type": lambda t: _fraction(t),
     "help": "dropout on the adapters' input (default 0)"}, ("lora",)),
    ("--lora-targets", "adapt.lora_targets", {"type": lambda t: _targets(t), "metavar": "qkv,proj,fc1,fc2",
     "help": "which projections of every block get adapters (default: all four)"}, ("lora",)),
    ("--save-adapters", "adapt.save_adapters", {"action": "store_true", "default": None,
     "help": "save the adapters and head apart from the base weights (loadable with the base checkpoint) "
     "instead of merged into a plain checkpoint"}, ("lora",)),
)  # fmt: skip
# train's options that mean nothing to a linear head fitted in closed form
GRADIENT_OPTIONS = ("epochs", "steps", "data.batch_size", "optim.lr", "precision", "compile", "grad_checkpointing",
                    "skip_nonfinite")  # fmt: skip
# the flag of each config field a named option sets: OPTIONS', --data's and (train's) --model's
FLAGS = {field: flag for flag, field, _ in OPTIONS} | {"data.source": "--data", "model.name": "--model"}


def _l2(text: str) -> float | str:
    return text if text == "auto" else positive_float(text)


def _fraction(text: str) -> float:
    value = positive_float(text, allow_zero=True)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _targets(text: str) -> tuple[str, ...]:
    from vitkit.models.lora import TARGET_MODULES

    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TARGET_MODULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{bad[0] if bad else 'no target'}: choose from {', '.join(TARGET_MODULES)} (comma-separated)"
        )
    return names


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
    return {f: getattr(args, f) for f in FLAGS if getattr(args, f, None) is not None}


def _add_train(sub: argparse._SubParsersAction) -> None:
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

    if args.resume:
        given = [FLAGS[f] for f in _changes(args)] + (["--set"] if args.sets else [])
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
    p = sub.add_parser(
        "finetune",
        help="adapt a checkpoint to your images: full fine-tuning, a linear head, LP-FT or LoRA",
        description="Adapt any supported checkpoint to the dataset's classes; the run folder's model/ is a normal "
        "checkpoint with the class names for predict, eval, serve and export. --method full (default): every weight "
        "trained from a zero-initialised head (the pre-logits layer dropped), the paper's SGD (momentum 0.9, "
        "cosine, no weight decay, clip 1) for a schedule sized by the data (printed; --recipe paper-finetune: the "
        "paper's Table 4 recipe at 384 px for a 224 px checkpoint), at the checkpoint's resolution. Methods that "
        "train keep the weights that do best on a validation split (the data set's own, else a tenth of train). "
        "--method linear: the backbone frozen, a multinomial logistic-regression head fitted on its pre-logits "
        "features (cached on disk, so another --l2 costs seconds), at the "
        "checkpoint's own resolution, no gradient steps. --method lp-ft: that head, then full fine-tuning from it "
        "(Kumar et al., ICLR 2022). --method lora: low-rank adapters on the blocks' projections and the head "
        "trained, the rest frozen; merged into the weights on save unless --save-adapters. "
        "Resume any of them with: vitkit train --resume RUN.",
    )
    p.add_argument("checkpoint", help="checkpoint to start from (any supported format, or a run folder)")
    p.add_argument(
        "--data", dest="data.source", required=True, help="dataset: an ImageFolder root, CIFAR folder, .npz, digits"
    )
    fine = sorted(k for k in RECIPES if "finetune" in k)
    p.add_argument(
        "--recipe",
        choices=fine,
        help="recipe (default: a schedule sized by the number of training images, printed; paper-finetune: the "
        "paper's Table 4 recipe exactly)",
    )
    p.add_argument("--method", choices=ADAPT_METHODS, default="full", help="how to adapt (default: full)")
    p.add_argument("--sweep", choices=["lr"], help="[full, lp-ft, lora] lr: train at 4 learning rates around the "
                   "run's (x0.1, x1/3, x1, x3) and keep the run that does best on the validation split")  # fmt: skip
    _add_options(p)
    for flag, field, kwargs, methods in ADAPT_OPTIONS:
        kwargs = {**kwargs, "help": f"[{', '.join(methods)}] {kwargs['help']}"}
        p.add_argument(flag, dest=field, **kwargs)
    p.set_defaults(func=cmd_finetune)


def _adapt_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The adaptation options given, by config field; a one-line error for one the method does not use."""
    method = args.method
    out: dict[str, Any] = {}
    for flag, field, _, methods in ADAPT_OPTIONS:
        value = getattr(args, field, None)
        if value is None:
            continue
        if method not in methods:
            raise VitkitError(f"{flag} applies to --method {' or '.join(methods)}, not --method {method}")
        out[field] = None if value == "auto" else value
    if method == "linear" and args.sweep:
        raise VitkitError("--sweep does not apply to --method linear: its L2 strength is already chosen on held-out "
                          "data (--l2 auto)")  # fmt: skip
    if method == "linear":
        given = [FLAGS[f] for f in GRADIENT_OPTIONS if getattr(args, f, None) is not None]
        if given:
            raise VitkitError(
                f"{given[0]} does not apply to --method linear: its head is fitted in closed form, with no gradient "
                "steps (--l2 sets its regularisation, --feature-precision the precision of its features)"
            )
    return out


def cmd_finetune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.configs import apply_overrides, finetune_config, get_recipe
    from vitkit.train import check_run_dir, train
    from vitkit.train.sweep import check_sweep, check_sweep_out, sweep_lr

    adapt = _adapt_changes(args)  # refused before any file is touched
    # the run folder before the checkpoint is read (train() checks it again when it claims it)
    if args.out is not None:
        (check_sweep_out if args.sweep else check_run_dir)(Path(args.out))
    else:  # runs/<name>, numbered when taken (finetune_config names a method's run <recipe>-<method>)
        name = (get_recipe(args.recipe).name if args.recipe else "finetune") + (
            "" if args.method == "full" else f"-{args.method}"
        )
        check_run_dir(Path("runs") / name, numbered=True)
    if args.method in ("linear", "lp-ft"):  # and where their features are kept
        from vitkit.train.feature_cache import check_root

        check_root(adapt.get("adapt.feature_cache"))
    notes: list[str] = []
    base = finetune_config(
        args.checkpoint,
        getattr(args, "data.source"),
        args.recipe,
        getattr(args, "data.image_size"),
        method=args.method,
        notes=notes,
        skip_bad=bool(getattr(args, "data.skip_bad")),
    )
    cfg = apply_overrides(base, {**_changes(args), **adapt}, args.sets)
    cfg.validate()  # a bad value is the one line, before any note
    if args.sweep:
        check_sweep(cfg)
    print_notes(notes)
    _note_emulated_bf16(cfg)
    if args.sweep:
        print(sweep_lr(cfg, args.out, progress=not args.quiet).summary())
        return 0
    result = train(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(result.summary())
    return 0
