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
        f"classes {cfg.num_classes}" + (f", pre-logits {cfg.representation_size}" if cfg.representation_size else "")
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
        default=["bf16"],
        choices=["fp32", "bf16-autocast", "bf16", "int8"],
        help="fp32, bf16-autocast (fp32 weights), bf16 (pure bf16 inference), int8 (dynamic, CPU); default bf16",
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
            precisions=tuple(args.precision),
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
    from vitkit.checkpoints import read_checkpoint
    from vitkit.models import create_model

    if os.path.exists(spec.model):
        return create_model(read_checkpoint(spec.model).cfg, image_size=spec.image_size)
    return create_model(spec.model, image_size=spec.image_size, num_classes=spec.num_classes)


# ---- entry point --------------------------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_info, _add_predict, _add_bench]


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
