"""``vitkit bench``: throughput, latency, memory and fraction of peak, optionally against transformers, ONNX
Runtime and OpenVINO."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitkit.commands.args import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput, latency, memory and fraction of peak FLOP/s, optionally against transformers and engines",
        description="Benchmark inference or a training step of a ViT: img/s (median, IQR, best), latency at "
        "batch 1, peak memory, achieved FLOP/s as a fraction of a peak measured in the same run, and output "
        "agreement with fp32. Runners alternate call by call in one process. Several --image-size/--batch-size "
        "values run a sweep (the cost curve; --plot draws it). Heavy: on a shared machine wrap it in a lock.",
    )
    p.add_argument("model", nargs="?", default="Ti/16", help="variant name (default Ti/16) or a checkpoint path")
    p.add_argument("--image-size", type=positive_int, nargs="+", default=[224], help="resolution(s) (default 224)")
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[8], help="batch size(s) (default 8)")
    p.add_argument("--task", choices=["inference", "train"], default="inference", help="what to time")
    p.add_argument(
        "--precision",
        nargs="+",
        choices=["fp32", "bf16-autocast", "bf16", "int8"],
        help="fp32, bf16-autocast (fp32 weights), bf16 (pure bf16 inference), int8 (dynamic, CPU); default bf16 "
        "where the hardware has bf16 instructions (AVX512_BF16 or AMX, CUDA), else fp32",
    )
    p.add_argument(
        "--compare",
        nargs="*",
        default=[],
        choices=["transformers", "onnxruntime", "openvino"],
        help="peer(s) to run side by side: transformers (same weights), onnxruntime (fp32, dynamic int8) and openvino "
        "(fp32, bf16 hint, NNCF int8) on vitkit's ONNX export (pip install 'vitkit[bench]')",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile every runner (compile time reported)")
    p.add_argument("--no-fast", action="store_true", help="leave out vitkit's inference fast path")
    p.add_argument("--grad-checkpointing", action="store_true", help="train: also run with activation checkpointing")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per runner (default 1)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed calls per runner (default 5)")
    p.add_argument("--no-latency", action="store_true", help="skip the batch-1 latency measurement")
    p.add_argument(
        "--real-images",
        action="store_true",
        help="also report top-1 agreement with fp32 on real images (scikit-learn's photos, crops, flips, digits)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's, one per core)")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON (an existing file needs --overwrite)")
    p.add_argument("--plot", metavar="PNG", help="with several image sizes: plot the cost curve")
    p.add_argument("--overwrite", action="store_true", help="replace existing --json / --plot files")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vitkit.bench.curve import attention_share, plot_cost_curve
    from vitkit.bench.harness import BenchSpec, run_bench
    from vitkit.bench.report import format_report
    from vitkit.checkpoints import model_from
    from vitkit.fileio import write_file_atomic
    from vitkit.inference.policy import bench_precisions
    from vitkit.output_paths import check_output_file

    for out in (args.json, args.plot):  # refused before minutes of measuring, never after them
        if out:
            check_output_file(Path(out), overwrite=args.overwrite)
    precisions = tuple(args.precision or bench_precisions(args.task, args.device))
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
        architecture = model_from(spec.model, device="meta", image_size=size, num_classes=spec.num_classes)
        result.update(attention_share(architecture, size))
        results.append(result)
        bar.update(1)
        tqdm.write(format_report(result), file=sys.stdout)
        sys.stdout.flush()
    bar.close()
    if args.json:
        doc = results if len(results) > 1 else results[0]
        write_file_atomic(Path(args.json), lambda tmp: tmp.write_text(json.dumps(doc, indent=2)))
    if args.plot:
        print(f"cost curve: {plot_cost_curve(results, args.plot)}")
    return 0
