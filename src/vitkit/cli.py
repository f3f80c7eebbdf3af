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

from vitkit.commands import hub as hub_commands
from vitkit.commands import serve as serve_command
from vitkit.errors import VitkitError

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("vitkit predict: error: ... (see --help)")."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _IntermixedParser(_Parser):
    """A subcommand parser whose file list may come before or after options (``cmd CKPT --opt x a.jpg b.jpg``).

    argparse's intermixed parsing calls ``parse_known_args`` again internally; the flag routes those inner
    calls to the plain parser.
    """

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


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


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


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
    p.add_argument("model", help="a variant name such as B/16, or a checkpoint (path, URL, registry name, hub id)")
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
    gh, gw = cfg.grid_at(size)
    summary = {
        "model": cfg.name or source,
        "image_size": list(size),
        "tokens": cfg.num_tokens(size),
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

    from vitkit.checkpoints import is_variant_name, read_checkpoint
    from vitkit.models import create_model
    from vitkit.models.vit import VisionTransformer

    overrides: dict[str, Any] = {}
    if args.num_classes is not None:
        overrides["num_classes"] = args.num_classes
    if not is_variant_name(args.model):
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
    p.add_argument(
        "--checkpoint", "-c", required=True, help="checkpoint: a path, URL, registry name (vitkit models) or hub id"
    )
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--top-k", type=_positive_int, default=5, help="how many labels per image (default 5)")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="images per forward pass")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vitkit.checkpoints import load_checkpoint
    from vitkit.checkpoints.preprocess import load_image

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
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file or vitkit-written folder")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.checkpoints import load_checkpoint, save_checkpoint
    from vitkit.checkpoints.verify import compare_models
    from vitkit.fileio import check_not_input

    check_not_input(Path(args.output), [args.input])  # before the (possibly long) load
    loaded = load_checkpoint(
        args.input,
        format=args.format,
        num_classes=args.num_classes,
        image_size=args.image_size,
        pos_interpolation=args.pos_interpolation,
    )
    out = save_checkpoint(loaded.model, args.output, args.to, meta=loaded.meta, overwrite=args.overwrite)
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
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.checkpoints import load_checkpoint
    from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx
    from vitkit.fileio import check_not_input, check_output_file

    check_not_input(Path(args.output), [args.checkpoint])
    check_output_file(Path(args.output), overwrite=args.overwrite)
    loaded = load_checkpoint(
        args.checkpoint, format=args.format, image_size=args.image_size, pos_interpolation=args.pos_interpolation
    )
    model = loaded.model
    metadata = {"preprocess": json.dumps(loaded.meta.preprocess.to_dict())}
    if loaded.meta.class_names:
        metadata["class_names"] = json.dumps(loaded.meta.class_names)
    out = export_onnx(
        model,
        args.output,
        dynamic_batch=args.dynamic_batch,
        opset=args.opset,
        metadata=metadata,
        overwrite=args.overwrite,
    )
    check = validate_onnx(model, out, (2, 3) if args.dynamic_batch else (2,))
    H, W = model.cfg.image_size
    print(
        f"wrote {out}: input images (B, {model.cfg.in_channels}, {H}, {W}), opset {args.opset}; onnxruntime vs "
        f"PyTorch on batch {', '.join(map(str, check.batch_sizes))}: max abs err {check.max_abs_err:.3g}, "
        f"rel err {check.rel_err:.3g}"
    )
    return 0


# ---- shared by eval, fewshot, analyze -------------------------------------------------------------------


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint: a vitkit folder or run folder, a Google .npz, ... (any format)")
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps or auto (default: auto)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="images per forward pass (default 64)")
    w = p.add_mutually_exclusive_group()
    w.add_argument(
        "--ema", dest="weights", action="store_const", const="ema", default="default",
        help="a training run: use the EMA (Polyak-averaged) weights of its latest checkpoint "
        "(default: the run's model/, which holds the EMA weights when the run used EMA)",
    )  # fmt: skip
    w.add_argument(
        "--no-ema", dest="weights", action="store_const", const="raw",
        help="a training run: use the raw, non-averaged weights of its latest checkpoint",
    )  # fmt: skip


def _add_data_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--data",
        required=required,
        help="dataset: 'digits', an ImageFolder root, a CIFAR python folder, an .npz, or WebDataset shards",
    )
    p.add_argument("--workers", type=_nonnegative_int, default=0, help="image-decoding worker processes (default 0)")
    p.add_argument("--skip-bad", action="store_true", help="skip unreadable images instead of failing")


def _load_for_eval(args: argparse.Namespace, image_size: tuple[int, int] | None = None) -> Any:
    from vitkit.evaluate.weights import load_for_eval

    loaded, note = load_for_eval(args.checkpoint, format=args.format, weights=args.weights, image_size=image_size)
    if note:
        print(f"note: {args.checkpoint}: {note}", file=sys.stderr)
    return loaded


def _open(source: str, split: str, skip_bad: bool, classes: list[str] | None = None) -> Any:
    """Open a dataset split; with ``classes`` (a checkpoint's), labels index those classes whenever the
    dataset's class names are a subset of them (a split missing a class, or another order)."""
    from vitkit.data.base import skipped_note
    from vitkit.data.datasets import open_dataset

    ds = open_dataset(source, split, skip_bad=skip_bad)
    if classes and list(ds.classes) != list(classes) and set(ds.classes) <= set(classes):
        ds = open_dataset(source, split, skip_bad=skip_bad, classes=classes)
    note = skipped_note(ds)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return ds


def _shots(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shots {text!r} (use e.g. 1,5,10,25)") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"invalid shots {text!r}: positive integers, e.g. 1,5,10,25")
    return values


def _l2(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid l2 {text!r} (a positive number, or auto)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"l2 must be positive, got {text}")
    return value


# ---- eval ---------------------------------------------------------------------------------------------


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from vitkit.evaluate.metrics import LABEL_FILE_HELP

    p = sub.add_parser(
        "eval",
        help="accuracy of a checkpoint on a dataset: top-1/top-5, per class, confusion matrix, ReaL",
        description="Evaluate a checkpoint (any supported format) on a dataset split. Preprocessing comes from "
        "the checkpoint. Writes metrics.json, per_class.csv, confusion.csv and confusion.png into --out.",
        epilog=LABEL_FILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_checkpoint_args(p)
    _add_data_args(p, required=True)
    p.add_argument("--split", default="test", help="dataset split (default: test)")
    p.add_argument("--real-labels", metavar="FILE", help="label-set file for ReaL-style accuracy (format below)")
    p.add_argument("--out", help="output folder (default: eval/<checkpoint name>-<split>)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.evaluate.evaluate import evaluate_dataset, write_eval_report
    from vitkit.hardware import resolve_device

    device = resolve_device(args.device)
    loaded = _load_for_eval(args)
    dataset = _open(args.data, args.split, args.skip_bad, loaded.meta.class_names)
    report = evaluate_dataset(
        loaded.model,
        dataset,
        loaded.meta.preprocess,
        class_names=loaded.meta.class_names,
        label_file=args.real_labels,
        batch_size=args.batch_size,
        device=device,
        workers=args.workers,
    )
    out = Path(args.out or Path("eval") / f"{Path(args.checkpoint).resolve().name}-{args.split}")
    paths = write_eval_report(report, out)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    m = report.metrics
    print(f"{args.checkpoint} on {args.data} [{args.split}]: {m.num_examples} examples")
    print(f"  top-1 {m.top1:.2%}   top-{m.k} {m.top5:.2%}")
    if m.real is not None:
        print(f"  ReaL top-1 {m.real:.2%} over {m.real_count} examples with a label set")
    worst = sorted((a, n) for n, a in zip(report.class_names, m.per_class, strict=True) if a == a)[:3]
    print("  lowest per-class accuracy: " + ", ".join(f"{n} {a:.1%}" for a, n in worst))
    print(f"  wrote {', '.join(str(p) for p in paths.values())}")
    return 0


# ---- fewshot ------------------------------------------------------------------------------------------


def _add_fewshot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fewshot",
        help="the paper's few-shot linear evaluation of a frozen checkpoint",
        description="Few-shot linear evaluation (paper sec. 4.1; big_vision fewshot_lsr): frozen pre-logits "
        "features, k examples per class from the training split, features standardised on them, bias column, "
        "closed-form L2-regularised least squares onto {-1,1}^K targets, accuracy on the whole test split; "
        "mean and standard deviation over seeds.",
    )
    _add_checkpoint_args(p)
    _add_data_args(p, required=True)
    p.add_argument("--train-split", default="train", help="split the shots are drawn from (default: train)")
    p.add_argument("--test-split", default="test", help="split accuracy is measured on (default: test)")
    p.add_argument("--shots", type=_shots, default=[1, 5, 10, 25], help="comma-separated (default 1,5,10,25)")
    p.add_argument("--seeds", type=_positive_int, default=3, help="number of random draws (default 3)")
    p.add_argument(
        "--l2",
        type=_l2,
        default=2.0**10,
        help="L2 regularisation: a number (default 1024 = 2^10, as big_vision) or 'auto' to choose it per "
        "draw on held-out training examples from a grid 2^-6 .. 2^16",
    )
    p.add_argument("--heldout", type=_positive_int, default=10, help="held-out examples per class for --l2 auto")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", help="also write the JSON results to this file")
    p.set_defaults(func=cmd_fewshot)


def cmd_fewshot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.evaluate.evaluate import fewshot_dataset
    from vitkit.hardware import resolve_device

    device = resolve_device(args.device)
    loaded = _load_for_eval(args)
    train = _open(args.data, args.train_split, args.skip_bad)
    test = _open(args.data, args.test_split, args.skip_bad)
    result = fewshot_dataset(
        loaded.model,
        train,
        test,
        loaded.meta.preprocess,
        shots=args.shots,
        seeds=range(args.seeds),
        l2=args.l2,
        heldout_per_class=args.heldout,
        batch_size=args.batch_size,
        device=device,
        workers=args.workers,
    )
    doc = {"checkpoint": args.checkpoint, "data": args.data, **result.to_dict()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.checkpoint}: few-shot linear probe on {args.data} ({args.train_split} -> {args.test_split})")
        print(result.table())
    return 0


# ---- analyze ------------------------------------------------------------------------------------------


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="the paper's figures: patch-embedding PCA, position-embedding similarity, attention distance, rollout",
        description="Look inside a ViT (paper fig. 6, 7, 11): principal components of the patch-embedding "
        "filters, cosine similarity of position embeddings, mean attention distance per head vs depth "
        "(averaged over the images; class token excluded, attention renormalised over patches), attention "
        "rollout from the class token (GAP models: mean over tokens) overlaid on each image, and one layer's "
        "raw attention maps. Writes PNGs and summary.json into --out.",
    )
    p.__class__ = _IntermixedParser  # images may follow options
    _add_checkpoint_args(p)
    p.set_defaults(batch_size=16)
    p.add_argument("images", nargs="*", help="image files for the attention analyses")
    _add_data_args(p, required=False)
    p.add_argument("--split", default="test", help="dataset split for --data (default: test)")
    p.add_argument("--num-images", type=_positive_int, default=128, help="images taken from --data (default 128)")
    p.add_argument("--out", default="analysis", help="output folder (default: analysis)")
    p.add_argument(
        "--layer", type=int, default=-1, help="layer of the raw attention maps, 1..L; negative counts from the end "
        "(default -1: the last)",
    )  # fmt: skip
    p.add_argument("--head", type=int, help="head of the raw attention maps, 1..heads (default: all heads)")
    p.add_argument("--max-overlays", type=_positive_int, default=8, help="images shown in figures (default 8)")
    p.add_argument("--image-size", type=_image_size, help="analyse at another resolution, e.g. 384 or 224x320")
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    from vitkit.analysis.analyze import AnalyzeOptions, analyze
    from vitkit.checkpoints.preprocess import load_image
    from vitkit.hardware import resolve_device

    device = resolve_device(args.device)
    loaded = _load_for_eval(args, image_size=args.image_size)
    images = [load_image(path) for path in args.images]  # fail on a bad file before any compute
    names = [os.path.basename(path) for path in args.images]
    if args.data:
        more, more_names = _sample_images(args.data, args.split, args.num_images, args.skip_bad)
        images += more
        names += more_names
    L, h = loaded.model.cfg.depth, loaded.model.cfg.num_heads
    if args.layer == 0 or not -L <= args.layer <= L:
        raise VitkitError(f"--layer {args.layer}: the model has {L} layers (1..{L}, or -1 for the last)")
    if args.head is not None and not 1 <= args.head <= h:
        raise VitkitError(f"--head {args.head}: the model has {h} heads (1..{h})")
    opts = AnalyzeOptions(
        layer=args.layer - 1 if args.layer > 0 else args.layer,
        head=None if args.head is None else args.head - 1,
        batch_size=args.batch_size,
        max_overlays=args.max_overlays,
    )
    summary = analyze(
        loaded.model, loaded.meta.preprocess, images, names, args.out, opts=opts, device=device,
        source=args.checkpoint,
    )  # fmt: skip
    print(f"{args.checkpoint}: analysed {len(images)} image(s); wrote to {args.out}/")
    for key, value in summary.items():
        if isinstance(value, dict):
            print(f"  {key:<30} {value.get('figure') or value.get('skipped')}")
    if "attention_distance" in summary:
        per_layer = summary["attention_distance"]["per_layer_mean"]
        print("  mean attention distance per layer (pixels): " + " ".join(f"{v:.1f}" for v in per_layer))
    return 0


def _sample_images(source: str, split: str, n: int, skip_bad: bool) -> tuple[list[Any], list[str]]:
    """n examples spread evenly over a dataset split (the first n of a stream)."""
    import numpy as np

    ds = _open(source, split, skip_bad)
    classes = list(ds.classes)
    if hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        idx = np.unique(np.linspace(0, len(ds) - 1, num=min(n, len(ds))).round().astype(int)).tolist()
        pairs = [(i, *ds[i]) for i in idx]
    else:
        pairs = []
        for i, (img, label) in enumerate(ds):
            if i >= n:
                break
            pairs.append((i, img, label))
    images = [img for _, img, _ in pairs]
    names = [f"{split}[{i}] {classes[label] if label < len(classes) else label}" for i, _, label in pairs]
    return images, names


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
    p.add_argument(
        "--seed", type=_nonnegative_int, help="seed for initialisation, data order, augmentation, dropout (>= 0)"
    )
    p.add_argument("--out", help="run folder (default runs/<recipe name>, numbered when taken)")
    p.add_argument("--workers", type=_nonnegative_int, help="data-loading worker processes per training process")
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
    p.add_argument(
        "--recipe", choices=sorted(RECIPES), help="recipe (default: digits, which is sized for the bundled digits)"
    )
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
        if given or args.recipe is not None:
            raise VitkitError(
                f"--resume continues a run with its saved config; drop {', '.join(given or ['--recipe'])}"
            )
        result = run(None, resume=args.resume, progress=not args.quiet)
    else:
        if args.recipe is None and args.data not in (None, "digits"):
            raise VitkitError(
                f"--data {args.data}: the default recipe trains a 16 px greyscale ViT for the bundled 8x8 digits; "
                "choose a recipe for these images with --recipe (cifar-small, plain-vit-s16, deit-i1k, ...; "
                "--recipe digits to keep it)"
            )
        cfg = train_config(args.recipe or "digits", data=args.data, model=args.model, **_training_options(args))
        _note_emulated_bf16(cfg)
        result = run(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(summary(result))
    return 0


def _note_emulated_bf16(cfg: Any) -> None:
    """Say so when bf16 autocast will run on a CPU that has no bf16 instructions (PyTorch emulates it)."""
    from vitkit.hardware import has_native_bf16, resolve_device

    device = resolve_device(cfg.device)  # how the run will resolve "auto"
    if cfg.precision == "bf16" and device.type == "cpu" and not has_native_bf16(device):
        print(
            "note: --precision bf16: this CPU has no bf16 instructions, so PyTorch emulates bf16 matmuls "
            "(tens of times slower than fp32); --precision fp32 is the fast choice here",
            file=sys.stderr,
        )


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    from vitkit.configs import RECIPES

    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on your images (new zero head, higher resolution)",
        description="Fine-tune any supported checkpoint: the head (and pre-logits) is replaced by a zero-initialised "
        "one for the dataset's classes, the position embeddings are interpolated to the new resolution (default: "
        "the checkpoint's scaled as the paper's 224 -> 384 px, e.g. 224 -> 384, 16 -> 28), and the paper's SGD "
        "recipe runs (momentum 0.9, cosine, no weight decay, clip 1; a shorter --steps shortens its warm-up). "
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

    notes: list[str] = []
    cfg = finetune_config(args.checkpoint, args.data, args.recipe, notes=notes, **_training_options(args))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    _note_emulated_bf16(cfg)
    result = run(cfg, args.out, progress=not args.quiet)
    if result.rank == 0:
        print(summary(result))
    return 0


# ---- bench --------------------------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput, latency, memory and fraction of peak FLOP/s, optionally against transformers",
        description="Benchmark inference or a training step of a ViT: img/s (median, IQR, best), latency at "
        "batch 1, peak memory, achieved FLOP/s as a fraction of a peak measured in the same run, and output "
        "agreement with fp32. Runners alternate call by call in one process. Several --image-size/--batch-size "
        "values run a sweep (the cost curve; --plot draws it). Heavy: on a shared machine wrap it in a lock.",
    )
    p.add_argument("model", nargs="?", default="Ti/16", help="variant name (default Ti/16) or a checkpoint path")
    p.add_argument("--image-size", type=_positive_int, nargs="+", default=[224], help="resolution(s) (default 224)")
    p.add_argument("--batch-size", type=_positive_int, nargs="+", default=[8], help="batch size(s) (default 8)")
    p.add_argument("--task", choices=["inference", "train"], default="inference", help="what to time")
    p.add_argument(
        "--precision",
        nargs="+",
        choices=["fp32", "bf16-autocast", "bf16", "int8"],
        help="fp32, bf16-autocast (fp32 weights), bf16 (pure bf16 inference), int8 (dynamic, CPU); default bf16 "
        "where the hardware has bf16 instructions (AVX512_BF16 or AMX, CUDA), else fp32",
    )
    p.add_argument("--compare", nargs="*", default=[], choices=["transformers"], help="peer(s) to run side by side")
    p.add_argument("--compile", action="store_true", help="torch.compile every runner (compile time reported)")
    p.add_argument("--no-fast", action="store_true", help="leave out vitkit's inference fast path")
    p.add_argument("--grad-checkpointing", action="store_true", help="train: also run with activation checkpointing")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per runner (default 1)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per runner (default 5)")
    p.add_argument("--no-latency", action="store_true", help="skip the batch-1 latency measurement")
    p.add_argument(
        "--real-images",
        action="store_true",
        help="also report top-1 agreement with fp32 on real images (scikit-learn's photos, crops, flips, digits)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=_positive_int, help="CPU threads (default: torch's, one per core)")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON")
    p.add_argument("--plot", metavar="PNG", help="with several image sizes: plot the cost curve")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vitkit.bench.curve import attention_share, plot_cost_curve
    from vitkit.bench.harness import BenchSpec, format_report, run_bench
    from vitkit.hardware import has_native_bf16

    precisions = tuple(args.precision or ["bf16" if has_native_bf16(args.device) else "fp32"])
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = [(s, b) for s in args.image_size for b in args.batch_size]
    results = []
    bar = tqdm(total=len(grid), desc="bench", unit="config", file=sys.stderr, disable=len(grid) < 2)
    for size, batch in grid:
        spec = BenchSpec(
            model=args.model,
            image_size=size,
            batch_size=batch,
            task=args.task,
            precisions=precisions,
            compile=args.compile,
            fast=not args.no_fast,
            compare=tuple(args.compare),
            grad_checkpointing=args.grad_checkpointing,
            warmup=args.warmup,
            repeats=args.repeats,
            latency=not args.no_latency,
            real_images=args.real_images,
            device=args.device,
        )
        result = run_bench(spec, progress=lambda msg: bar.set_postfix_str(msg[:40]))
        with torch.device("meta"):
            result.update(attention_share(_bench_architecture(spec), size))
        results.append(result)
        bar.update(1)
        tqdm.write(format_report(result), file=sys.stdout)
        sys.stdout.flush()
    bar.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)
    if args.plot:
        print(f"cost curve: {plot_cost_curve(results, args.plot)}")
    return 0


def _bench_architecture(spec: Any) -> Any:
    """The benchmarked architecture on the meta device (for FLOP accounting only)."""
    from vitkit.checkpoints import is_variant_name, read_checkpoint
    from vitkit.models import create_model

    if not is_variant_name(spec.model):
        return create_model(read_checkpoint(spec.model).cfg, image_size=spec.image_size)
    return create_model(spec.model, image_size=spec.image_size, num_classes=spec.num_classes)


# ---- entry point --------------------------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_info,
    _add_predict,
    _add_train,
    _add_finetune,
    _add_eval,
    _add_fewshot,
    _add_analyze,
    _add_convert,
    _add_export,
    _add_bench,
    hub_commands.add_parser,
    serve_command.add_parser,
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
    except BrokenPipeError:  # the reader went away (vitkit info B/16 --json | head -1): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except OSError as e:  # the disk or file system said no (full, read-only, a file where a folder goes...)
        where = f"{e.filename}: " if e.filename else ""
        print(f"vitkit {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
