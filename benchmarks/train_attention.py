"""One attention layer of a training step, forward + backward: vitkit's C attention kernel against the
explicit path it replaces (``softmax_attention`` with the C softmax), on S/16 b32 shapes.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/train_attention.py [--calls 20] [--tokens 197]

Both take the fused projection qkv (32, T, 3 x 384) bf16 (6 heads of 64) and a gradient of the output, and
run forward then backward through autograd (the gradient of qkv is what the qkv Linear's backward reads).
Median wall time over ``--calls`` calls after three warm-ups each, the two alternating call by call
(``vitkit.timing.time_alternating``), freed memory kept in the heap as the trainer does (``heap_kept``).
"""

from __future__ import annotations

import argparse

import torch

from vitkit.models.attention import softmax_attention
from vitkit.timing import time_alternating
from vitkit.train import kernels
from vitkit.train.heap import heap_kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=[197])
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    with_attention = kernels.load()
    softmax_only = kernels.load(attention=False)
    if with_attention is None or softmax_only is None or with_attention.attention_lib is None:
        raise SystemExit("the C training kernels cannot run here (no C compiler or no AVX-512 BF16)")
    torch.manual_seed(0)
    heads, d = 6, 64
    print("| tokens | softmax_attention + C softmax (ms) | C attention kernel (ms) | speed-up |")
    print("|---|---|---|---|")
    for T in args.tokens:
        qkv = (torch.randn(args.batch, T, 3 * heads * d) * 2).bfloat16().requires_grad_()
        g = torch.randn(args.batch, T, heads * d).bfloat16()

        def step(k: kernels.CpuTrainingKernels, qkv: torch.Tensor = qkv, g: torch.Tensor = g) -> None:
            qkv.grad = None
            softmax_attention(qkv, heads, d**-0.5, k).backward(g)

        runners = {"explicit": lambda: step(softmax_only), "kernel": lambda: step(with_attention)}
        with heap_kept():
            for fn in runners.values():
                for _ in range(3):
                    fn()
        with heap_kept():
            t = time_alternating(runners, args.calls, torch.device("cpu"), torch.get_num_threads())
        a, b = t["explicit"].median * 1e3, t["kernel"].median * 1e3
        print(f"| {T} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
