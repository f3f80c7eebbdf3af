"""ATen against vitkit's C training kernels (``vitkit.train.kernels``) on one S/16 b32 layer's shapes.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/train_kernels.py [--calls 30]

Median wall time of each op over ``--calls`` calls after three warm-up calls, ATen and kernel alternating
per op: GELU forward and GELU backward + fc1 bias-gradient sum on the fc1 activation (32 x 197 tokens x
1536, bf16), softmax forward on the attention logits (32 x 6 heads, 197 x 197, bf16; the kernel in place).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitkit.timing import time_alternating
from vitkit.train import kernels


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    return time_alternating({"fn": fn}, calls, torch.device("cpu"), torch.get_num_threads())["fn"].median * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    k = kernels.load()
    if k is None:
        raise SystemExit("the C training kernels cannot run here (no C compiler or no AVX-512 BF16)")
    torch.manual_seed(0)
    h = (torch.randn(32 * 197, 1536) * 2).bfloat16()
    dy = torch.randn_like(h)
    logits = (torch.randn(32 * 6, 197, 197) * 4).bfloat16()
    work = logits.clone()
    ops = {
        "GELU forward": (lambda: F.gelu(h), lambda: k.gelu(h)),
        "GELU backward + bias-gradient sum": (
            lambda: torch.ops.aten.gelu_backward(dy, h).sum(0),
            lambda: k.gelu_backward_bias(dy, h),
        ),
        "softmax forward": (lambda: torch.softmax(logits, -1), lambda: k.softmax_(work)),
    }
    print("| op | ATen (ms) | C kernel (ms) |")
    print("|---|---|---|")
    for name, (aten, kernel) in ops.items():
        print(f"| {name} | {_median_ms(aten, args.calls):.2f} | {_median_ms(kernel, args.calls):.2f} |")


if __name__ == "__main__":
    main()
