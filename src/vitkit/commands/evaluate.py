"""``vitkit eval``, ``vitkit fewshot``, ``vitkit knn``, ``vitkit analyze``: a checkpoint measured and looked inside.

kNN is a command of its own rather than an option of ``eval``: it measures a backbone, so it runs on checkpoints
without a classification head (which ``eval`` refuses), takes two splits (or two ``embed`` outputs, with no
checkpoint at all) and reports top-1/top-5 only, none of eval's per-class report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vitkit.commands.args import (
    IntermixedParser,
    add_checkpoint_args,
    add_data_args,
    add_decode_arg,
    add_engine_args,
    check_out_of_inputs,
    image_size,
    join_processes,
    leave_processes,
    load_checkpoint_args,
    parsed,
    positive_float,
    positive_int,
    print_notes,
    report_engine,
    resolve_workers,
)
from vitkit.errors import ConfigError, VitkitError


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_eval(sub)
    _add_fewshot(sub)
    _add_knn(sub)
    _add_analyze(sub)


def _shots(text: str) -> list[int]:
    invalid = f"invalid shots {text!r} (use e.g. 1,5,10,25)"
    values = parsed(text, lambda t: sorted({int(s) for s in t.split(",") if s.strip()}), invalid)
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"invalid shots {text!r}: positive integers, e.g. 1,5,10,25")
    return values


def _l2(text: str) -> float | str:
    if text == "auto":
        return text
    value = parsed(text, float, f"invalid l2 {text!r} (a positive number, or auto)")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"l2 must be positive, got {text}")
    return value


def _run_options(args: argparse.Namespace, device: Any, dist: Any = None, *, engine: bool = True) -> Any:
    """The evaluators' one :class:`~vitkit.inference.features.ExtractOptions`, from a command's options
    (``engine``: its ``--precision``, and ``--backend``/``--decode`` where it has them)."""
    from vitkit.inference.features import ExtractOptions

    chosen = {"precision": args.precision, "backend": getattr(args, "backend", "torch"),
              "decode": getattr(args, "decode", "cpu")} if engine else {}  # fmt: skip
    backend = chosen.get("backend", "torch")
    return ExtractOptions(batch_size=args.batch_size, workers=resolve_workers(args.workers, device, backend),
                          skip_bad=args.skip_bad, device=device, on_engine=report_engine, dist=dist,
                          **chosen)  # fmt: skip


def _open_split(args: argparse.Namespace, split: str, **kw: Any) -> Any:
    """``--data``'s ``split``, nothing decoded yet: with ``--skip-bad`` an image that does not decode is left out
    when the job's stream reaches it (``predecode=False``, as predict and embed open theirs)."""
    from vitkit.data.datasets import open_noted

    return open_noted(args.data, split, skip_bad=args.skip_bad, predecode=False, **kw)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from vitkit.evaluate.metrics import LABEL_FILE_HELP

    p = sub.add_parser(
        "eval",
        help="accuracy of a checkpoint on a dataset: top-1/top-5, per class, confusion matrix, ReaL",
        description="Evaluate a checkpoint (any supported format) on a dataset split. Preprocessing comes from "
        "the checkpoint. Writes metrics.json, per_class.csv, confusion.csv and confusion.png into --out. Under "
        "torchrun the dataset is shared out over the processes; the report is the one a single process gives.",
        epilog=LABEL_FILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint_args(p)
    add_engine_args(p, device=False)
    add_data_args(p, required=True)
    add_decode_arg(p)
    p.add_argument("--split", default="test", help="dataset split (default: test)")
    p.add_argument("--real-labels", metavar="FILE", help="label-set file for ReaL-style accuracy (format below)")
    p.add_argument("--out", help="output folder (default: eval/<checkpoint name>-<split>)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from vitkit.evaluate.evaluate import check_eval_report_dir, evaluate_dataset, write_eval_report

    out = Path(args.out or Path("eval") / f"{Path(args.checkpoint).resolve().name}-{args.split}")
    info = join_processes(args.device)  # under torchrun: this process's share of the dataset
    if info.is_main:
        check_eval_report_dir(out)  # refused before the evaluation, never after it
        check_out_of_inputs(out, args.data)
    loaded = load_checkpoint_args(args)
    dataset = _open_split(args, args.split, classes=loaded.meta.class_names, strict_classes=False)
    report = evaluate_dataset(loaded.model, dataset, loaded.meta.preprocess, class_names=loaded.meta.class_names,
                              label_file=args.real_labels, opts=_run_options(args, info.device, info))  # fmt: skip
    leave_processes(info)
    if not info.is_main:
        return 0  # process 0 writes the report of the whole dataset
    paths = write_eval_report(report, out)
    print_notes(report.notes)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    m = report.metrics
    print(f"{args.checkpoint} on {args.data} [{args.split}]: {m.num_examples} examples")
    print(f"  top-1 {m.top1:.2%}   top-{m.k} {m.top5:.2%}   {report.precision_note()}".rstrip())
    if m.real is not None:
        print(f"  ReaL top-1 {m.real:.2%} over {m.real_count} examples with a label set")
    worst = sorted((a, n) for n, a in zip(report.class_names, m.per_class, strict=True) if a == a)[:3]
    print("  lowest per-class accuracy: " + ", ".join(f"{n} {a:.1%}" for a, n in worst))
    print(f"  wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _add_fewshot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fewshot",
        help="the paper's few-shot linear evaluation of a frozen checkpoint",
        description="Few-shot linear evaluation (paper sec. 4.1; big_vision fewshot_lsr): frozen pre-logits "
        "features, k examples per class from the training split, features standardised on them, bias column, "
        "closed-form L2-regularised least squares onto {-1,1}^K targets, accuracy on the whole test split; "
        "mean and standard deviation over seeds. With --train-embeddings/--test-embeddings the features are read "
        "from two outputs of 'vitkit embed' (made from a labelled dataset) instead of computed: no checkpoint needed.",
    )
    add_checkpoint_args(p, optional=True)
    add_engine_args(p, backend=False, device=False)
    add_data_args(p, required=False)
    p.add_argument("--train-embeddings", metavar="FILE", help="cached training features: an output of vitkit embed")
    p.add_argument("--test-embeddings", metavar="FILE", help="cached test features: an output of vitkit embed")
    p.add_argument("--train-split", default="train", help="split the shots are drawn from (default: train)")
    p.add_argument("--test-split", default="test", help="split accuracy is measured on (default: test)")
    p.add_argument("--shots", type=_shots, default=[1, 5, 10, 25], help="comma-separated (default 1,5,10,25)")
    p.add_argument("--seeds", type=positive_int, default=3, help="number of random draws (default 3)")
    p.add_argument(
        "--l2",
        type=_l2,
        default=2.0**10,
        help="L2 regularisation: a number (default 1024 = 2^10, as big_vision) or 'auto' to choose it per "
        "draw on held-out training examples from a grid 2^-6 .. 2^16",
    )
    p.add_argument("--heldout", type=positive_int, default=10, help="held-out examples per class for --l2 auto")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", help="also write the JSON results to this file (an existing file needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_fewshot)


def cmd_fewshot(args: argparse.Namespace) -> int:
    from vitkit.evaluate.fewshot import fewshot_dataset, fewshot_embeddings
    from vitkit.hardware import resolve_device
    from vitkit.output_paths import check_output_file

    if args.out:  # refused before the work, never after it
        check_output_file(Path(args.out), overwrite=args.overwrite)
        check_out_of_inputs(args.out, args.data)
    probe = {"shots": args.shots, "seeds": range(args.seeds), "l2": args.l2, "heldout_per_class": args.heldout}
    if check_embedding_inputs(args):
        result = fewshot_embeddings(args.train_embeddings, args.test_embeddings, **probe)
        source = {"train_embeddings": args.train_embeddings, "test_embeddings": args.test_embeddings}
        what = f"{args.train_embeddings} -> {args.test_embeddings}"
    else:
        loaded = load_checkpoint_args(args)
        train, test = _open_split(args, args.train_split), _open_split(args, args.test_split)
        result = fewshot_dataset(loaded.model, train, test, loaded.meta.preprocess, **probe,
                                 opts=_run_options(args, resolve_device(args.device)))  # fmt: skip
        print_notes(result.notes)
        source = {"checkpoint": args.checkpoint, "data": args.data}
        what = f"{args.checkpoint} on {args.data} ({args.train_split} -> {args.test_split})"
    return _report(args, {**source, **result.to_dict()}, [f"{what}: few-shot linear probe", result.table()])


def _report(args: argparse.Namespace, doc: dict[str, Any], lines: list[str]) -> int:
    """An evaluator's result: written to ``--out`` as JSON, then printed as JSON (``--json``) or as ``lines``."""
    from vitkit.fileio import write_file_atomic

    if args.out:
        write_file_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))
    print(json.dumps(doc, indent=2) if args.json else "\n".join(lines))
    return 0


def _add_knn(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "knn",
        help="weighted k-nearest-neighbour accuracy of a backbone (the DINO protocol), from a dataset or embeddings",
        description="k-nearest-neighbour classification on frozen features (DINO, Caron et al. 2021): train and "
        "test features L2-normalised, each test image's k most cosine-similar training images vote for their "
        "labels with weight exp(similarity / T), votes summed per class; top-1 and top-5 accuracy. Features are "
        "the checkpoint's pre-logits features on --data's two splits, or read from two outputs of 'vitkit embed' "
        "(--train-embeddings, --test-embeddings; any --pool/--layer, made from a labelled dataset). The search runs "
        "in blocks of --query-chunk x --bank-chunk similarities, so a bank of millions fits in memory. Under "
        "torchrun the feature extraction is shared out over the processes.",
    )
    add_checkpoint_args(p, optional=True)
    add_engine_args(p, backend=False, device=False)
    add_data_args(p, required=False)
    p.add_argument("--train-split", default="train", help="the bank's split of --data (default: train)")
    p.add_argument("--test-split", default="test", help="the split classified (default: test)")
    p.add_argument("--train-embeddings", metavar="FILE", help="the bank: an output of vitkit embed (train split)")
    p.add_argument("--test-embeddings", metavar="FILE", help="the test features: an output of vitkit embed")
    p.add_argument("-k", "--k", type=positive_int, default=20, help="neighbours that vote (default 20)")
    p.add_argument("--temperature", type=positive_float, default=0.07, help="T of the weights (default 0.07)")
    p.add_argument("--query-chunk", type=positive_int, default=256, help="test rows per block (default 256)")
    p.add_argument("--bank-chunk", type=positive_int, default=65536, help="bank rows per block (default 65536)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result to this file (an existing file needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_knn)


def check_embedding_inputs(args: argparse.Namespace) -> bool:
    """Whether a command reads features from ``--train-embeddings``/``--test-embeddings`` (both given) or computes
    them from a checkpoint and ``--data``; ConfigError for any other mix."""
    given = [args.train_embeddings is not None, args.test_embeddings is not None]
    if any(given):
        if not all(given):
            raise ConfigError("--train-embeddings and --test-embeddings go together")
        if args.data:
            raise ConfigError("give --data (with a checkpoint) or --train-embeddings/--test-embeddings, not both")
        return True
    if not args.checkpoint or not args.data:
        raise ConfigError("give a checkpoint and --data, or --train-embeddings and --test-embeddings")
    return False


def cmd_knn(args: argparse.Namespace) -> int:
    from vitkit.evaluate.knn import knn_dataset, knn_embeddings
    from vitkit.output_paths import check_output_file

    info = join_processes(args.device)  # under torchrun: this process's share of the images
    if args.out and info.is_main:  # refused before the work, never after it
        check_output_file(Path(args.out), overwrite=args.overwrite)
        check_out_of_inputs(args.out, args.data)
    chunks = {"k": args.k, "temperature": args.temperature, "query_chunk": args.query_chunk,
              "bank_chunk": args.bank_chunk}  # fmt: skip
    if check_embedding_inputs(args):
        notes: list[str] = []
        report = knn_embeddings(args.train_embeddings, args.test_embeddings, **chunks, notes=notes)
        print_notes(notes)
        what = f"{args.train_embeddings} -> {args.test_embeddings}"
    else:
        loaded = load_checkpoint_args(args)
        train, test = _open_split(args, args.train_split), _open_split(args, args.test_split)
        report = knn_dataset(loaded.model, train, test, loaded.meta.preprocess, **chunks,
                             opts=_run_options(args, info.device, info))  # fmt: skip
        if info.is_main:
            print_notes(report.notes)
        what = f"{args.checkpoint} on {args.data} ({args.train_split} -> {args.test_split})"
    leave_processes(info)
    if not info.is_main:
        return 0
    return _report(args, {"features": what, **report.to_dict()}, [
        f"{what}: kNN (k={report.k}, T={report.temperature:g}) over {report.num_train} training images",
        f"  top-1 {report.top1:.2%}   top-5 {report.top5:.2%}   ({report.num_test} test images)",
    ])  # fmt: skip


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
    p.__class__ = IntermixedParser  # images may follow options
    add_checkpoint_args(p)
    p.set_defaults(batch_size=16)
    p.add_argument("images", nargs="*", help="image files for the attention analyses")
    add_data_args(p, required=False)
    p.add_argument("--split", default="test", help="dataset split for --data (default: test)")
    p.add_argument("--num-images", type=positive_int, default=128, help="images taken from --data (default 128)")
    p.add_argument("--out", default="analysis", help="output folder (default: analysis)")
    p.add_argument(
        "--layer", type=int, default=-1, help="layer of the raw attention maps, 1..L; negative counts from the end "
        "(default -1: the last)",
    )  # fmt: skip
    p.add_argument("--head", type=int, help="head of the raw attention maps, 1..heads (default: all heads)")
    p.add_argument("--max-overlays", type=positive_int, default=8, help="images shown in figures (default 8)")
    p.add_argument("--image-size", type=image_size, help="analyse at another resolution, e.g. 384 or 224x320")
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    from vitkit.analysis.analyze import AnalysisImages, AnalyzeOptions, analyze, check_analysis_dir, dataset_positions
    from vitkit.data.stream import list_inputs
    from vitkit.hardware import resolve_device

    check_analysis_dir(args.out)  # refused before loading anything, never after the analyses
    check_out_of_inputs(args.out, args.images, args.data)
    device = resolve_device(args.device)
    loaded = load_checkpoint_args(args, image_size=args.image_size)
    files = list_inputs(args.images, skip_bad=args.skip_bad)  # a missing file: one line, before any compute
    dataset = _open_split(args, args.split) if args.data else None
    positions = dataset_positions(dataset, args.num_images) if dataset is not None else []
    L, h = loaded.model.cfg.depth, loaded.model.cfg.num_heads
    if args.layer == 0 or not -L <= args.layer <= L:
        raise VitkitError(f"--layer {args.layer}: the model has {L} layers (1..{L}, or -1 for the last)")
    if args.head is not None and not 1 <= args.head <= h:
        raise VitkitError(f"--head {args.head}: the model has {h} heads (1..{h})")
    opts = AnalyzeOptions(
        layer=args.layer - 1 if args.layer > 0 else args.layer,
        head=None if args.head is None else args.head - 1,
        max_overlays=args.max_overlays,
    )
    pictures = AnalysisImages(files, None, dataset, positions)
    summary = analyze(loaded.model, loaded.meta.preprocess, pictures, None, args.out, opts=opts,
                      run=_run_options(args, device, engine=False), source=args.checkpoint)  # fmt: skip
    print_notes(summary.get("attention_distance", {}).get("notes", []))
    print(f"{args.checkpoint}: analysed {len(pictures)} image(s); wrote to {args.out}/")
    for key, value in summary.items():
        if isinstance(value, dict):
            print(f"  {key:<30} {value.get('figure') or value.get('skipped')}")
    if "attention_distance" in summary:
        per_layer = summary["attention_distance"]["per_layer_mean"]
        print("  mean attention distance per layer (pixels): " + " ".join(f"{v:.1f}" for v in per_layer))
    return 0
