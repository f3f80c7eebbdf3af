"""Benchmarking and the inference fast path.

- ``peak``: the machine's peak FLOP/s, measured in the same run (C FMA loop, or large-matmul fallback);
- ``harness``: ``run_bench(BenchSpec(...))``: throughput, latency, memory, fraction of peak, agreement;
- ``peers``: transformers' ViT holding the same weights;
- ``fast``: ``optimize_for_inference``, the fast inference path;
- ``curve``: throughput against image size, and attention's N^2 share.
"""

from vitkit.bench.fast import optimize_for_inference

__all__ = ["optimize_for_inference"]
