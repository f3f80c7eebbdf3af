"""Fused C attention kernel against the fast path's PyTorch attention, end to end, alternating in one process.

For each model: the bf16 (and int8) fast path built once, then timed call by call with the kernel on and off
(``FastBlock.fused`` set to None: the batched-GEMM + softmax path), after warm-ups, on random images::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/attention_ab.py B/16 S/16

Prints img/s medians (and the best call) of both and their ratio, and the relative difference of the final tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vitkit import optimize_for_inference
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.models import create_model


def set_fused(fast: InferenceViT, kernel: object) -> None:
    for b in fast.blocks:
        if isinstance(b, FastBlock):
            b.fused = kernel  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--precision", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.models:
        model = create_model(name).eval()
        x = torch.randn(args.batch_size, 3, 224, 224)
        for precision in args.precision:
            fast = optimize_for_inference(model, batch_size=args.batch_size, int8=precision == "int8")
            assert isinstance(fast, InferenceViT)
            kernel = next(b.fused for b in fast.blocks if isinstance(b, FastBlock))
            if kernel is None:
                print(f"{name} {precision}: the fused kernel is not available on this machine")
                continue
            times: dict[str, list[float]] = {"fused": [], "torch": []}
            outs = {}
            with torch.inference_mode():
                for i in range(args.repeats + 2):
                    for mode in ("fused", "torch"):
                        set_fused(fast, kernel if mode == "fused" else None)
                        start = time.perf_counter()
                        outs[mode] = fast.forward_features(x)  # (the official init's head is zero)
                        if i >= 2:
                            times[mode].append(time.perf_counter() - start)
            rate = {m: args.batch_size / statistics.median(t) for m, t in times.items()}
            best = {m: args.batch_size / min(t) for m, t in times.items()}
            diff = ((outs["fused"].float() - outs["torch"].float()).norm() / outs["torch"].float().norm()).item()
            print(
                f"{name} b{args.batch_size} {precision}: fused {rate['fused']:.2f} img/s (best {best['fused']:.2f}), "
                f"torch attention {rate['torch']:.2f} (best {best['torch']:.2f}), "
                f"ratio {rate['fused'] / rate['torch']:.3f}; tokens rel. diff {diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
