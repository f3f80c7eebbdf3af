"""The ``vitkit`` command line. Each subcommand is a thin layer over the public Python API.

Errors in the user's input (files, options, checkpoints) end with one line on stderr naming the cause,
and exit status 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vitkit.errors import VitkitError

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("vitkit predict: error: ... (see --help)")."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _image_size(text: str) -> tuple[int, int]:
    """ "224" -> (224, 224); "224x320" -> (224, 320)."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid image size {text!r} (use 224 or 224x320)") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"invalid image size {text!r} (use 224 or 224x320)")
    return parts[0], parts[1]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# ---- info ---------------------------------------------------------------------------------------------


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="architecture, parameter table, GMACs/GFLOPs of a variant or checkpoint",
        description="Show a model's configuration, a per-component parameter table, and the compute of one "
        "forward pass (GMACs, and GFLOPs at 2 FLOPs per multiply-add) at a given resolution.",
    )
    p.add_argument("model", help="a variant name such as B/16, or a checkpoint path")
    p.add_argument("--image-size", type=_image_size, help="resolution, e.g. 384 or 224x320 (default: model's)")
    p.add_argument("--num-classes", type=int, help="number of classes of the head (default: 1000 / checkpoint's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    from vitkit.models.cost import cost_table

    model, source = _model_for_info(args)
    cfg = model.cfg
    rows = cost_table(model, args.image_size)
    total_params = sum(r.params for r in rows)
    total_macs = sum(r.macs for r in rows)
    size = args.image_size or cfg.image_size
    gh, gw = size[0] // model.stem_stride, size[1] // model.stem_stride
    summary = {
        "model": cfg.name or source,
        "image_size": list(size),
        "tokens": gh * gw + cfg.num_prefix_tokens,
        "config": cfg.to_dict(),
        "components": [{"component": r.component, "params": r.params, "macs": r.macs} for r in rows],
        "params": total_params,
        "gmacs": total_macs / 1e9,
        "gflops": 2 * total_macs / 1e9,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['model']}: image {size[0]}x{size[1]}, {gh}x{gw} patches -> {summary['tokens']} tokens")
    print(
        f"  width {cfg.hidden_size}, depth {cfg.depth}, heads {cfg.num_heads}, MLP {cfg.mlp_dim}, "
        f"patch {cfg.patch_size}, classifier {cfg.classifier}, pos-emb {cfg.pos_embed}, GELU {cfg.gelu}, "
        f"classes {cfg.num_classes}"
        + (f", pre-logits {cfg.representation_size}" if cfg.representation_size else "")
        + (f", ResNet stages {list(cfg.resnet_layers)} (stride {cfg.stride})" if cfg.resnet_layers is not None else "")
    )
    print(f"  {'component':<28}{'params':>16}{'GMACs':>12}")
    for r in rows:
        print(f"  {r.component:<28}{r.params:>16,}{r.macs / 1e9:>12.4g}")
    print(f"  {'total':<28}{total_params:>16,}{total_macs / 1e9:>12.4g}")
    print(f"  {total_macs / 1e9:.4g} GMACs = {2 * total_macs / 1e9:.4g} GFLOPs per image (2 FLOPs per multiply-add)")
    return 0


def _model_for_info(args: argparse.Namespace) -> tuple[Any, str]:
    import torch

    from vitkit.checkpoints import read_checkpoint
    from vitkit.models import create_model
    from vitkit.models.vit import VisionTransformer

    overrides: dict[str, Any] = {}
    if args.num_classes is not None:
        overrides["num_classes"] = args.num_classes
    if os.path.exists(args.model):
        cfg = read_checkpoint(args.model).cfg
        with torch.device("meta"):
            model = create_model(cfg, **overrides)
        return model, args.model
    if args.image_size:
        overrides["image_size"] = args.image_size
    with torch.device("meta"):  # shapes only: no memory, no init cost, even for H/14
        model = create_model(args.model, **overrides)
    assert isinstance(model, VisionTransformer)
    return model, args.model


# ---- predict ------------------------------------------------------------------------------------------


def _add_predict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="top-k labels for images with a checkpoint",
        description="Classify images with any supported checkpoint. Preprocessing (resize, mean/std) is "
        "taken from the checkpoint; labels from its class names when it has them.",
    )
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument("--checkpoint", "-c", required=True, help="checkpoint path (file or folder)")
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--top-k", type=_positive_int, default=5, help="how many labels per image (default 5)")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="images per forward pass")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.preprocess import load_image

    loaded = load_checkpoint(args.checkpoint, format=args.format)
    model, pre = loaded.model, loaded.meta.preprocess
    if model.cfg.num_classes <= 0:
        raise VitkitError(f"{args.checkpoint}: the model has no classification head; nothing to predict")
    images = [load_image(path) for path in args.images]  # fail on a bad file before any compute
    k = min(args.top_k, model.cfg.num_classes)
    batches = range(0, len(images), args.batch_size)
    results = []
    with torch.inference_mode():
        for start in tqdm(batches, desc="predict", unit="batch", disable=len(batches) < 2, file=sys.stderr):
            x = torch.stack([pre.to_tensor(img) for img in images[start : start + args.batch_size]])
            probs = model(x).float().softmax(dim=-1)
            top_p, top_i = probs.topk(k, dim=-1)
            for j in range(x.shape[0]):
                pairs = [(loaded.label(int(i)), float(p)) for p, i in zip(top_p[j], top_i[j], strict=True)]
                results.append((args.images[start + j], pairs))
    for path, pairs in results:
        if args.json:
            print(json.dumps({"image": path, "top": [{"label": lab, "prob": p} for lab, p in pairs]}))
        else:
            print(path)
            for rank, (lab, p) in enumerate(pairs, 1):
                print(f"  {rank}. {lab:<40} {p:7.2%}")
    return 0


# ---- convert ------------------------------------------------------------------------------------------


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", help="input checkpoint format, if detection should be overridden")
    p.add_argument("--image-size", type=_image_size, help="new resolution, e.g. 384 or 384x512 (resamples pos-emb)")
    p.add_argument(
        "--pos-interpolation",
        choices=["bilinear", "bicubic"],
        default="bilinear",
        help="position-embedding resampling for --image-size: bilinear = official interpolate_posembed "
        "(scipy zoom order 1, default), bicubic = timm/HF",
    )


def _add_convert(sub: argparse._SubParsersAction) -> None:
    from vitkit.checkpoints import FORMATS

    writable = [f.name for f in FORMATS.values() if f.save is not None]
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to another format (vitkit, official, big_vision, hf, timm)",
        description="Read any supported checkpoint and write it in another format, keeping class names and "
        "preprocessing where the target can hold them. The written file is read back and its outputs compared "
        "with the source model on random images; the relative error is printed.",
    )
    p.add_argument("input", help="checkpoint path (file or folder)")
    p.add_argument("output", help="output path (.npz for official/big_vision; folder for vitkit/hf; "
                   ".safetensors/.pth or folder for timm)")  # fmt: skip
    p.add_argument("--to", required=True, choices=writable, help="output format")
    _add_load_options(p)
    p.add_argument("--num-classes", type=int, help="replace the head by a zero-initialised one for N classes")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from vitkit.checkpoints import load_checkpoint, save_checkpoint
    from vitkit.checkpoints.verify import compare_models

    loaded = load_checkpoint(
        args.input,
        format=args.format,
        num_classes=args.num_classes,
        image_size=args.image_size,
        pos_interpolation=args.pos_interpolation,
    )
    out = save_checkpoint(loaded.model, args.output, args.to, meta=loaded.meta)
    again = load_checkpoint(out, format=args.to, image_size=loaded.model.cfg.image_size)
    err = compare_models(loaded.model, again.model)
    print(f"wrote {out} ({args.to}); read back: max abs err {err.max_abs_err:.3g}, rel err {err.rel_err:.3g}")
    return 0


# ---- export -------------------------------------------------------------------------------------------


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX, validated with onnxruntime",
        description="Export any supported checkpoint to ONNX (torch dynamo exporter) and check the file with "
        "onnxruntime against the PyTorch model on random images; prints the max abs and relative error.",
    )
    p.add_argument("checkpoint", help="checkpoint path (file or folder)")
    p.add_argument("output", help="output .onnx file")
    _add_load_options(p)
    p.add_argument("--dynamic-batch", action="store_true", help="free batch axis (default: batch fixed at 2)")
    p.add_argument("--opset", type=_positive_int, default=18, help="ONNX opset version (default 18)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from vitkit.checkpoints import load_checkpoint
    from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx

    loaded = load_checkpoint(
        args.checkpoint, format=args.format, image_size=args.image_size, pos_interpolation=args.pos_interpolation
    )
    model = loaded.model
    out = export_onnx(model, args.output, dynamic_batch=args.dynamic_batch, opset=args.opset)
    check = validate_onnx(model, out, (2, 3) if args.dynamic_batch else (2,))
    H, W = model.cfg.image_size
    print(
        f"wrote {out}: input images (B, {model.cfg.in_channels}, {H}, {W}), opset {args.opset}; onnxruntime vs "
        f"PyTorch on batch {', '.join(map(str, check.batch_sizes))}: max abs err {check.max_abs_err:.3g}, "
        f"rel err {check.rel_err:.3g}"
    )
    return 0


# ---- train / finetune ---------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_training_options(p: argparse.ArgumentParser) -> None:
    """The few overrides shared by train and finetune; recipes carry everything else."""
    p.add_argument("--epochs", type=_positive_float, help="training length in epochs (replaces the recipe's)")
    p.add_argument("--steps", type=_positive_int, help="training length in optimiser steps (wins over epochs)")
    p.add_argument("--batch-size", type=_positive_int, help="global batch size (all processes, accumulation)")
    p.add_argument("--lr", type=_positive_float, help="base learning rate")
    p.add_argument("--image-size", type=_image_size, help="training resolution, e.g. 384 or 224x320")
    p.add_argument("--seed", type=int, help="seed for initialisation, data order, augmentation, dropout")
    p.add_argument("--out", help="run folder (default runs/<recipe name>, numbered when taken)")
    p.add_argument("--workers", type=int, help="data-loading worker processes per training process")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: autocast with fp32 master weights")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--skip-bad", action="store_true", default=None, help="skip unreadable images (counted)")
    p.add_argument(
        "--skip-nonfinite", action="store_true", default=None, help="skip (and count) steps whose loss is NaN/inf"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. --set optim.weight_decay=0.1 --set aug.augreg=medium1 (JSON values)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _training_options(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("epochs", "steps", "batch_size", "lr", "image_size", "seed", "workers", "precision", "compile")
    opts = {k: getattr(args, k) for k in keys}
    opts["skip_bad"], opts["skip_nonfinite"], opts["sets"] = args.skip_bad, args.skip_nonfinite, args.sets
    return opts


def _add_train(sub: argparse._SubParsersAction) -> None:
    from vitkit.configs import RECIPES

    p = sub.add_parser(
        "train",
        help="train a ViT from scratch (default: the bundled 8x8 digits)",
        description="Train a ViT from a recipe. With no arguments: a small ViT on scikit-learn's bundled 8x8 "
        "digits, then the test accuracy. Writes runs/<name>/ (model/, checkpoints/, config.json, metrics.csv, "
        "curves.png). Multi-process: torchrun --nproc_per_node N -m vitkit train ...",
    )
    p.add_argument("--recipe", default="digits", choices=sorted(RECIPES), help="recipe (default: digits)")
    p.add_argument("--data", help="dataset: digits, an ImageFolder root, a CIFAR folder, an .npz, WebDataset shards")
    p.add_argument("--model", help="a variant such as S/16 (replaces the recipe's architecture)")
    p.add_argument("--resume", metavar="RUN", help="continue a run (its folder or a checkpoint) exactly")
    _add_training_options(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from vitkit.train.launch import run, summary, train_config

    if args.resume:
        given = [k for k, v in _training_options(args).items() if v not in (None, [])]
        given += [k for k in ("data", "model", "out") if getattr(args, k) is not None]
        if given or args.recipe != "digits":
            raise VitkitError(
                f"--resume continues a run with its saved config; drop {', '.join(given or ['--recipe'])}"
            )
        result = run(None, resume=args.resume, progress=not args.quiet)
    else:
        cfg = train_config(args.recipe, data=args.data, model=args.model, **_training_options(args))
        result = run(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(summary(result))
    return 0


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
    p.add_argument("--data", required=True, help="dataset: an ImageFolder root, CIFAR folder, .npz, shards, digits")
    fine = sorted(k for k in RECIPES if "finetune" in k)
    p.add_argument("--recipe", default="paper-finetune", choices=fine, help="recipe (default: paper-finetune)")
    _add_training_options(p)
    p.set_defaults(func=cmd_finetune)


def cmd_finetune(args: argparse.Namespace) -> int:
    from vitkit.train.launch import finetune_config, run, summary

    cfg = finetune_config(args.checkpoint, args.data, args.recipe, **_training_options(args))
    result = run(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(summary(result))
    return 0


# ---- entry point --------------------------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_info,
    _add_predict,
    _add_train,
    _add_finetune,
    _add_convert,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    from vitkit import __version__

    parser = _Parser(
        prog="vitkit",
        description="Vision Transformers (Dosovitskiy et al., ICLR 2021): train, fine-tune, evaluate, analyse, "
        "convert. Run 'vitkit COMMAND --help' for each command.",
    )
    parser.add_argument("--version", action="version", version=f"vitkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except VitkitError as e:
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"vitkit {args.command}: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
