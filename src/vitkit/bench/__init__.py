"""Benchmarks: measurement only (the fast path they time is :mod:`vitkit.inference`).

- ``peak``: the machine's peak FLOP/s, measured in the same run (C FMA loop, or large-matmul fallback);
- ``harness``: ``run_bench(BenchSpec(...))``: throughput, latency, memory, fraction of peak, agreement;
- ``report``: speed over the peers, and the text table of a result;
- ``measure``: peak memory of one call (the timing of alternating runners is :mod:`vitkit.timing`);
- ``peers``: transformers' ViT holding the same weights;
- ``engines``: ONNX Runtime and OpenVINO on vitkit's ONNX export (``--compare onnxruntime openvino``);
- ``curve``: throughput against image size, and attention's N^2 share.
"""
