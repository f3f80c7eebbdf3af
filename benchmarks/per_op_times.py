"""Wall time per op of the bf16 (or int8) inference fast path, by ``time.perf_counter`` around each module call.

torch.profiler distorts the small ops of the fast path (it put B/16's qkv GEMM at 388 GFLOP/s where its wall
time says ~1000); this wraps the ``forward`` of every stage of every ``FastBlock`` (norm1, qkv, the attention
kernel, proj, norm2, fc1, fc2) and of the stem and head, runs a few calls, and prints ms per call per stage,
GFLOP/s where there is a FLOP count, and "python/other" = the call's wall time that no wrapped stage accounts
for (the interpreter between them, reshapes, the MLP chunk loop)::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/per_op_times.py Ti/16 S/16

The wrapping itself costs ~1 us per stage call (a few hundred per forward), charged to the stages.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from vitkit import create_model, optimize_for_inference
from vitkit.inference.fast import FastBlock, InferenceViT

STAGES = ("stem", "norm1", "qkv", "attention", "proj", "norm2", "fc1", "fc2", "final norm", "head")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "int8"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.models:
        model = create_model(name).eval()
        cfg = model.cfg
        fast = optimize_for_inference(model, batch_size=args.batch_size, int8=args.precision == "int8")
        assert isinstance(fast, InferenceViT)
        x = torch.randn(args.batch_size, 3, *cfg.image_size)
        spent: dict[str, float] = defaultdict(float)

        def timed(stage: str, fn: Callable[..., Any], spent: dict[str, float] = spent) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                out = fn(*a, **k)
                spent[stage] += time.perf_counter() - t
                return out

            return call

        base = fast.base
        base.embed = timed("stem", base.embed)  # type: ignore[method-assign]
        if fast.stem is not None:  # the patch embedding as a packed GEMM
            fast.stem.forward = timed("stem", fast.stem.forward)  # type: ignore[method-assign]
        fast.norm.forward = timed("final norm", fast.norm.forward)  # type: ignore[method-assign]
        base.forward_head = timed("head", base.forward_head)  # type: ignore[method-assign]
        for b in fast.blocks:
            assert isinstance(b, FastBlock)
            for stage in ("norm1", "qkv", "proj", "norm2", "fc1", "fc2"):
                mod = getattr(b, stage)
                mod.forward = timed(stage, mod.forward)
            if b.fused is not None:
                b.fused = timed("attention", b.fused)  # type: ignore[assignment]
                b.fused.supports = lambda *a, k=b.fused: True  # type: ignore[attr-defined]
        with torch.inference_mode():
            for _ in range(2):
                fast(x)
            spent.clear()
            walls = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fast(x)
                walls.append(time.perf_counter() - t)
        n = args.repeats
        wall = sum(walls) / n
        B, T, D, L = args.batch_size, cfg.num_tokens(), cfg.hidden_size, cfg.depth
        M, H = B * T, cfg.mlp_dim
        flops = {
            "qkv": 2 * M * D * 3 * D * L,
            "proj": 2 * M * D * D * L,
            "fc1": 2 * M * D * H * L,
            "fc2": 2 * M * H * D * L,
            "attention": 4 * B * T * T * D * L,
        }
        img_s = B / wall
        print(f"{name} b{B} {args.precision}: call {wall * 1e3:.1f} ms (min {min(walls) * 1e3:.1f}), {img_s:.2f} img/s")
        accounted = 0.0
        for stage in STAGES:
            ms = spent[stage] / n * 1e3
            accounted += ms
            rate = f", {flops[stage] / (ms / 1e3) / 1e9:.0f} GFLOP/s" if stage in flops and ms else ""
            print(f"  {stage:12s} {ms:8.2f} ms  {100 * ms / (wall * 1e3):5.1f}%{rate}")
        rest = wall * 1e3 - accounted
        print(f"  {'python/other':12s} {rest:8.2f} ms  {100 * rest / (wall * 1e3):5.1f}%", flush=True)


if __name__ == "__main__":
    main()
