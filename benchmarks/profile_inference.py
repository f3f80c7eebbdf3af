"""Per-op profile of vitkit's inference fast path (bf16 and int8): where one batch's time goes.

Runs ``optimize_for_inference`` on a randomly initialised variant (default ViT-B/16, 224 px, batch 32)
under ``torch.profiler`` and sorts every top-level operator of the forward into a stage: the four GEMMs
of a block (told apart by their weight shapes), attention (q k^T, softmax, probabilities x v, or a fused
kernel: SDPA's or vitkit's C kernel), LayerNorm, activation quantisation, layout copies, the stem/head, and
"python/other" (the wall time no operator accounts for: interpreter overhead between calls). Each stage's
GFLOP/s is given where it has a FLOP count (from ``vitkit.models.cost.cost_table``-like arithmetic below).

    PYTHONPATH=src python benchmarks/profile_inference.py [--model B/16] [--batch-size 32] [--precision bf16 int8]

Times are the median over ``--repeats`` profiled calls (after warm-up); run it under the CPU lock.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from vitkit import create_model, optimize_for_inference
from vitkit.bench.harness import flops_per_image

STAGES = (
    "qkv GEMM",
    "out-proj GEMM (+residual)",
    "fc1 GEMM (+GELU)",
    "fc2 GEMM (+residual)",
    "attention: q k^T",
    "attention: softmax",
    "attention: probs x v",
    "attention: fused kernel",
    "LayerNorm",
    "quantise activations",
    "layout copies",
    "stem + head",
    "other ops",
    "python/other",
)


def classify(name: str, shapes: list[Any], D: int) -> str:
    """The stage of one top-level operator, from its name and input shapes."""
    low = name.lower()
    gemm = re.match(r"vitkit::gemm_u8s8 m=(\d+) k=(\d+) n=(\d+)", low)  # the VNNI int8 GEMM's region
    if gemm:
        M, K, N = (int(v) for v in gemm.groups())
        name, low, shapes = "qlinear", "qlinear", [[M, K], [N, K]]
    if "linear_pointwise" in low or "qlinear" in low or low in ("aten::linear", "aten::addmm", "aten::mm"):
        # weight shapes differ by GEMM: the qkv weight has 3D outputs, fc1 4D, fc2 has K = 4D
        flat = [s for s in shapes if isinstance(s, list) and s]
        x = flat[0] if flat else []
        K = x[-1] if x else D
        dims = {d for s in flat[1:] for d in s}
        if K == 4 * D:
            return "fc2 GEMM (+residual)"
        if 3 * D in dims:
            return "qkv GEMM"
        if 4 * D in dims:
            return "fc1 GEMM (+GELU)"
        if K == D and D in dims:
            return "out-proj GEMM (+residual)"
        return "stem + head"
    if low == "aten::bmm" or low == "aten::matmul":
        a = shapes[0] if shapes and isinstance(shapes[0], list) else []
        b = shapes[1] if len(shapes) > 1 and isinstance(shapes[1], list) else []
        if a and b and a[-1] == b[-2] and a[-1] == a[-2]:  # (n, T, T) x (n, T, d)
            return "attention: probs x v"
        return "attention: q k^T"
    if "softmax" in low:
        return "attention: softmax"
    if "scaled_dot_product" in low or "flash_attention" in low or "fused_attention" in low:
        return "attention: fused kernel"
    if "layer_norm" in low or "layernorm_bf16" in low:
        return "LayerNorm"
    if "compiled" in low or "quantize" in low or "aminmax" in low or "inductor" in low:
        return "quantise activations"
    if low in ("aten::contiguous", "aten::clone", "aten::copy_", "aten::reshape", "aten::to", "aten::_to_copy"):
        return "layout copies"
    if "conv" in low or low in ("aten::cat", "aten::add", "aten::expand"):
        return "stem + head"
    return "other ops"


def gemm_flops(batch: int, T: int, D: int, heads: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of each stage over the whole model, per block times depth elsewhere."""
    BT = batch * T
    return {
        "qkv GEMM": 2.0 * BT * D * 3 * D,
        "out-proj GEMM (+residual)": 2.0 * BT * D * D,
        "fc1 GEMM (+GELU)": 2.0 * BT * D * 4 * D,
        "fc2 GEMM (+residual)": 2.0 * BT * 4 * D * D,
        "attention: q k^T": 2.0 * batch * T * T * D,
        "attention: probs x v": 2.0 * batch * T * T * D,
        "attention: fused kernel": 4.0 * batch * T * T * D,
    }


def profile_once(fast: torch.nn.Module, x: torch.Tensor, D: int) -> tuple[dict[str, float], float]:
    """Stage -> milliseconds for one call, and the call's wall time in ms."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        fast(x)
        wall = (time.perf_counter() - start) * 1e3
    stages: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.cpu_parent is not None:
            continue
        stages[classify(ev.name, list(ev.input_shapes or []), D)] += ev.cpu_time_total / 1e3
    stages["python/other"] = max(0.0, wall - sum(stages.values()))
    return stages, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="B/16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--precision", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_model(args.model, image_size=args.image_size).eval()
    cfg = model.cfg
    D, heads, depth, T = cfg.hidden_size, cfg.num_heads, cfg.depth, cfg.num_tokens()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    flops = {k: v * depth for k, v in gemm_flops(args.batch_size, T, D, heads).items()}
    results: dict[str, tuple[dict[str, float], float]] = {}
    for precision in args.precision:
        fast = optimize_for_inference(model, int8=precision == "int8", batch_size=args.batch_size)
        with torch.inference_mode():
            for _ in range(2):
                fast(x)
            runs = [profile_once(fast, x, D) for _ in range(args.repeats)]
        walls = [w for _, w in runs]
        median = sorted(range(len(runs)), key=lambda i: walls[i])[len(runs) // 2]
        results[precision] = runs[median]
        del fast
    names = list(results)
    print(f"{args.model} @ {args.image_size}px, batch {args.batch_size}, {torch.get_num_threads()} threads")
    header = " | ".join(f"{p} ms | {p} % | {p} GFLOP/s" for p in names)
    print(f"| stage | {header} |")
    print("|---|" + "---|---|---|" * len(names))
    for stage in STAGES:
        cells = []
        if all(results[p][0].get(stage, 0.0) < 0.05 for p in names):
            continue
        for p in names:
            ms = results[p][0].get(stage, 0.0)
            rate = f"{flops[stage] / ms / 1e6:.0f}" if stage in flops and ms > 0.05 else "-"
            cells.append(f"{ms:.1f} | {100 * ms / results[p][1]:.1f}% | {rate}")
        print(f"| {stage} | " + " | ".join(cells) + " |")
    total_flops = args.batch_size * flops_per_image(model, args.image_size)
    total = " | ".join(f"{results[p][1]:.1f} | 100% | {total_flops / results[p][1] / 1e6:.0f}" for p in names)
    print(f"| **whole call** | {total} |")
    rates = ", ".join(f"{p} {args.batch_size / results[p][1] * 1e3:.2f}" for p in names)
    print(f"(img/s under the profiler: {rates}; the call of median wall time of {args.repeats})")


if __name__ == "__main__":
    main()
