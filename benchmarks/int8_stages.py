"""Where the int8 fast path's call goes, timed by hand (``time.perf_counter`` around each module), not by
``torch.profiler`` (which inflated some GEMM rows 1.4-2.6x, BENCHMARKS.md).

Builds the int8 fast path of a randomly initialised model, wraps each stage of every ``FastBlock`` (the fused
LayerNorm + quantiser, each GEMM, each activation quantiser, attention) and the stem / final norm / head with a
wall-clock timer, and prints per stage the time per call summed over the layers (median of ``--repeats``
calls after 2 warm-ups) and GOP/s for the GEMMs and attention. "block rest" is each block's wall time that no
wrapped stage accounts for (the MLP chunk loop, allocations, Python); "call rest" the same for the whole call::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/int8_stages.py B/16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from vitkit import create_model, optimize_for_inference
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.inference.int8 import Int8Linear

Times = dict[str, float]


def timed(fn: Callable[..., Any], name: str, acc: Times) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[name] += time.perf_counter() - start
        return out

    return run


class TimedKernel:
    """A kernel object (``FusedAttention``) whose calls are timed; other attributes pass through."""

    def __init__(self, kernel: Any, name: str, acc: Times) -> None:
        self.kernel, self.call = kernel, timed(kernel, name, acc)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def instrument(fast: InferenceViT, acc: Times) -> None:
    for b in fast.blocks:
        assert isinstance(b, FastBlock)
        for name in ("qkv", "proj", "fc1", "fc2"):
            lin = getattr(b, name)
            assert isinstance(lin, Int8Linear)
            lin.quantize = timed(lin.quantize, f"{name}: quantise input", acc)
            lin.forward_quantized = timed(lin.forward_quantized, f"{name}: GEMM", acc)  # type: ignore[method-assign]
        if getattr(b, "rows_quantize", None) is not None:  # the attention output and fc1's output quantised per row
            b.rows_quantize = timed(b.rows_quantize, "proj + fc2: quantise inputs per row", acc)
        b.norm1_q.forward = timed(b.norm1_q.forward, "norm1 + quantise", acc)  # type: ignore[method-assign]
        b.norm2_q.forward = timed(b.norm2_q.forward, "norm2 + quantise", acc)  # type: ignore[method-assign]
        if b.fused is not None:
            b.fused = TimedKernel(b.fused, "attention kernel", acc)  # type: ignore[assignment]
        b.forward = timed(b.forward, "block", acc)  # type: ignore[method-assign]
    fast.base.embed = timed(fast.base.embed, "stem (patch embed)", acc)  # type: ignore[method-assign]
    if fast.stem is not None:  # the fast path's packed stem, where it takes the images
        fast.stem.forward = timed(fast.stem.forward, "stem (patch embed)", acc)  # type: ignore[method-assign]
    fast.norm.forward = timed(fast.norm.forward, "final norm", acc)  # type: ignore[method-assign]
    fast.base.forward_head = timed(fast.base.forward_head, "head", acc)  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="B/16")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = create_model(args.model).eval()
    cfg = model.cfg
    x = torch.randn(args.batch_size, 3, 224, 224)
    fast = optimize_for_inference(model, batch_size=args.batch_size, int8=True)
    assert isinstance(fast, InferenceViT)
    acc: Times = defaultdict(float)
    instrument(fast, acc)
    runs: list[Times] = []
    with torch.inference_mode():
        for i in range(args.repeats + 2):
            acc.clear()
            start = time.perf_counter()
            fast(x)
            acc["call"] = time.perf_counter() - start
            if i >= 2:
                runs.append(dict(acc))
    med = {k: statistics.median(r.get(k, 0.0) for r in runs) * 1e3 for k in runs[0]}
    inner = [k for k in med if k not in ("call", "block", "stem (patch embed)", "final norm", "head")]
    med["block rest"] = med["block"] - sum(med[k] for k in inner)
    med["call rest"] = med["call"] - med["block"] - med["stem (patch embed)"] - med["final norm"] - med["head"]
    D, T, B, depth = cfg.hidden_size, cfg.num_tokens(), args.batch_size, cfg.depth
    BT, hidden = B * T, fast.blocks[0].fc1_features  # type: ignore[union-attr]
    ops = {
        "qkv: GEMM": 2.0 * BT * D * 3 * D,
        "proj: GEMM": 2.0 * BT * D * D,
        "fc1: GEMM": 2.0 * BT * D * hidden,
        "fc2: GEMM": 2.0 * BT * D * hidden,
        "attention kernel": 4.0 * B * T * T * D,
    }
    print(f"{args.model} b{B} int8, {torch.get_num_threads()} threads, median of {args.repeats} calls")
    print("| stage | ms per call | % | GOP/s |\n|---|---|---|---|")
    for k in [*inner, "block rest", "stem (patch embed)", "final norm", "head", "call rest", "call"]:
        rate = f"{ops[k] * depth / med[k] / 1e6:.0f}" if k in ops else "-"
        print(f"| {k} | {med[k]:.1f} | {100 * med[k] / med['call']:.1f}% | {rate} |")
    print(f"({B / med['call'] * 1e3:.2f} img/s)")


if __name__ == "__main__":
    main()
