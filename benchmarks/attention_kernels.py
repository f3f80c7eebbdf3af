"""Forward + backward time of one attention layer on CPU: the explicit softmax(q k^T) v against PyTorch's
fused scaled_dot_product_attention, bf16 autocast, S/16 shapes (6 heads of 64), batch 32.

    PYTHONPATH=src python benchmarks/attention_kernels.py

This is what the trainer's ``attention="auto"`` rests on (src/vitkit/train/trainer.py).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def step_seconds(
    tokens: int, explicit: bool, batch: int = 32, heads: int = 6, dim: int = 64, repeats: int = 5
) -> float:
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, tokens, dim, requires_grad=True) for _ in range(3))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if explicit:
                out = ((q * dim**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
            else:
                out = F.scaled_dot_product_attention(q, k, v)
        out.float().sum().backward()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    print("| tokens | explicit (ms) | fused SDPA (ms) | fused / explicit |")
    print("|---|---|---|---|")
    for tokens in (17, 197, 257, 401, 577):
        e, f = step_seconds(tokens, True), step_seconds(tokens, False)
        print(f"| {tokens} | {e * 1e3:.1f} | {f * 1e3:.1f} | {f / e:.2f} |")


if __name__ == "__main__":
    main()
