"""Variants of the bf16 inference fast path, end to end, alternating call by call in one process.

The bf16 fast path is built once per model; each variant (``--variant``, ``NAME=0|1[,NAME=0|1]``) switches parts
of it on or off before its call: ``ln``, the C LayerNorm (``vitkit.inference.layernorm``) or PyTorch's;
``stem``, the patch embedding as a pre-packed GEMM (``vitkit.inference.stem``) or the model's convolution.
After 2 warm-up rounds the variants are timed call by call, alternating (``vitkit.timing.time_alternating``)::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/bf16_ab.py Ti/16 S/16 \\
        --variant ln=0 ln=1 --repeats 15

Prints img/s medians (best call) per variant, their ratio to the first variant, and the relative difference of
each variant's logits-free output (final tokens) from the first's.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from vitkit import optimize_for_inference
from vitkit.inference.fast import InferenceViT
from vitkit.inference.layernorm import NativeLayerNorm
from vitkit.models import create_model
from vitkit.timing import time_alternating


def configure(fast: InferenceViT, settings: dict[str, int], saved: dict[int, Any]) -> None:
    for m in fast.modules():
        if "ln" in settings and isinstance(m, NativeLayerNorm):
            saved.setdefault(id(m), m.fn)
            m.fn = saved[id(m)] if settings["ln"] else None
    if "stem" in settings:
        fast.use_stem = bool(settings["stem"])  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--variant", nargs="+", default=["ln=0", "ln=1"], help="NAME=0|1[,NAME=0|1] per variant")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    variants = {v: {k: int(m) for k, m in (kv.split("=") for kv in v.split(","))} for v in args.variant}
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    for name in args.models:
        torch.manual_seed(0)
        model = create_model(name).eval()
        x = torch.randn(args.batch_size, 3, *model.cfg.image_size)
        fast = optimize_for_inference(model, batch_size=args.batch_size)
        assert isinstance(fast, InferenceViT)
        outs: dict[str, torch.Tensor] = {}
        saved: dict[int, Any] = {}

        def run(v: str, fast: InferenceViT = fast, x: torch.Tensor = x, saved: dict = saved) -> None:
            configure(fast, variants[v], saved)
            outs[v] = fast.forward_features(x)  # noqa: B023 (outs is read right after the loop body)

        fns = {v: functools.partial(run, v) for v in variants}
        with torch.inference_mode():
            time_alternating(fns, 2, cpu, threads)  # warm-up
            timings = time_alternating(fns, args.repeats, cpu, threads)
        first = next(iter(variants))
        base = args.batch_size / timings[first].median
        ref = outs[first].float()
        for v, t in timings.items():
            rate = args.batch_size / t.median
            diff = ((outs[v].float() - ref).norm() / ref.norm()).item()
            print(
                f"{name} b{args.batch_size} bf16 {v}: {rate:.2f} img/s (best {args.batch_size / min(t.times):.2f}), "
                f"x{rate / base:.3f}, cpu {t.cpu_util:.2f}, tokens rel. diff {diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
