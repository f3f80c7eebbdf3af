"""The int8 GEMMs of B/16's fast path in isolation: the VNNI kernel (``vitkit.inference.gemm_int8``) against
oneDNN's ``qlinear_pointwise`` (weights pre-packed for the rows, as ``Int8Linear`` calls it), on the same
quantised operands, alternating call by call (``vitkit.timing.time_alternating``)::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/gemm_int8_ab.py

Shapes (rows x K x N, epilogue): the qkv GEMM and out-projection + residual over batch 32 x 197 tokens, and
fc1 + GELU and fc2 + residual over an MLP chunk of 1576 rows. Prints ms medians, GOP/s and their share of the
in-run VNNI FMA-loop peak, the ratio, and the relative difference of the two outputs.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from vitkit.bench.peak import fma_loop_peak
from vitkit.inference import gemm_int8, int8
from vitkit.timing import time_alternating

SHAPES = [(6304, 768, 2304, "none"), (6304, 768, 768, "add"), (1576, 768, 3072, "gelu"), (1576, 3072, 768, "add")]


def _given(qs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], _x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return qs


def _call(
    layer: int8.Int8Linear, x: torch.Tensor, other: torch.Tensor | None, outs: dict[str, torch.Tensor], name: str
) -> None:
    outs[name] = layer(x, other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    gemm = gemm_int8.load()
    if gemm is None:
        raise SystemExit("the VNNI int8 GEMM cannot be built here (AVX512_VNNI/BF16 and a C compiler needed)")
    threads, cpu = torch.get_num_threads(), torch.device("cpu")
    peak = fma_loop_peak("int8", threads)
    print(f"in-run int8 peak: {peak.flops / 1e9:.0f} GOP/s" if peak else "no int8 peak measured")
    torch.manual_seed(0)
    for M, K, N, epilogue in SHAPES:
        linear = nn.Linear(K, N)
        x = torch.randn(M, K).to(torch.bfloat16)
        other = torch.randn(M, N).to(torch.bfloat16) if epilogue == "add" else None
        layers = {
            "onednn": int8.Int8Linear(linear, torch.bfloat16, epilogue, M, int8.quantize_dynamic_u8),
            "vnni": int8.Int8Linear(linear, torch.bfloat16, epilogue, M, int8.quantize_dynamic_u8, gemm),
        }
        q, scale, zero = int8.quantize_dynamic_u8(x)
        outs: dict[str, torch.Tensor] = {}
        for layer in layers.values():
            layer.quantize = functools.partial(_given, (q, scale, zero))  # the same operands, quantised once
        fns = {name: functools.partial(_call, layer, x, other, outs, name) for name, layer in layers.items()}
        with torch.inference_mode():
            time_alternating(fns, 2, cpu, threads)
            t = time_alternating(fns, args.repeats, cpu, threads)
        ops = 2 * M * K * N
        a, b = outs["onednn"].float(), outs["vnni"].float()
        diff = ((a - b).norm() / a.norm()).item()
        for name, tt in t.items():
            rate = ops / tt.median / 1e9
            share = f" ({rate / (peak.flops / 1e9):.0%} of peak)" if peak else ""
            print(f"{M}x{K}x{N} {epilogue:9s} {name:6s}: {tt.median * 1e3:6.2f} ms, {rate:5.0f} GOP/s{share}")
        ratio = t["onednn"].median / t["vnni"].median
        print(f"{M}x{K}x{N} {epilogue:9s} vnni over onednn: x{ratio:.3f}, outputs' rel. diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
