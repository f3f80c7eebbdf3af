"""Fused C attention kernel against the fast path's PyTorch attention, end to end, alternating in one process.

For each model: the bf16 (and int8) fast path built once, then timed call by call with the kernel on and off
(``FastBlock.fused`` set to None: the batched-GEMM + softmax path), after warm-ups, on random images::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/attention_ab.py B/16 S/16

Prints img/s medians (and the best call) of both and their ratio, and the relative difference of the final tokens.
With ``--layer``, one layer's attention in isolation instead (the model's shapes, batch 32, best of 5 ms):
the fused kernel, the fast path's PyTorch form (batched GEMMs + softmax over cached chunks, with the copies
around it), and PyTorch's ``scaled_dot_product_attention`` on contiguous q, k, v (``--flex``: also
``torch.nn.attention.flex_attention`` compiled by inductor, which needs a C++ compiler). ``--layer --against
OLD.c``: the kernel built from another version of its source against this one instead, alternating call by call
in one process (15 rounds; min and median ms), e.g. the previous commit's::

    git show HEAD~1:src/vitkit/inference/attention.c > /tmp/old.c
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/attention_ab.py B/16 --layer \
        --against /tmp/old.c

``--layer --int8``: the bf16 kernel against its int8 variant (``attention_int8.c``, the int8 fast path's) the same
way, and each one's relative error from fp32 SDPA on the same bf16 q, k, v. ``--layer --int8 --against OLD.c``: the
int8 variant built from another version of ``attention_int8.c`` against this one (feeds BENCHMARKS.md, "int8
attention past 65,536 keys")::

    git show main:src/vitkit/inference/attention_int8.c > /tmp/old_int8.c
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/attention_ab.py B/16 S/16 \
        --layer --int8 --against /tmp/old_int8.c
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from vitkit import native, optimize_for_inference
from vitkit.inference import attention
from vitkit.inference import fast as fast_mod
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.models import create_model
from vitkit.timing import time_alternating


def set_fused(fast: InferenceViT, kernel: object) -> None:
    for b in fast.blocks:
        if isinstance(b, FastBlock):
            b.fused = kernel  # type: ignore[assignment]


def best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    timing = time_alternating({"fn": fn}, repeats, torch.device("cpu"), torch.get_num_threads())["fn"]
    return min(timing.times) * 1e3


def one_layer(name: str, batch: int, flex: bool = False) -> None:
    """ms and GFLOP/s of one layer's attention, three ways (see the module docstring)."""
    kernel = attention.load()
    cfg = create_model(name).cfg
    B, T, h, d = batch, cfg.num_tokens(), cfg.num_heads, cfg.hidden_size // cfg.num_heads
    qkv = torch.randn(B * T, 3 * h * d).to(torch.bfloat16)
    scaled = qkv.clone()
    scaled[:, : h * d] *= d**-0.5  # the fast path folds the scale into the query weights
    block = FastBlock.__new__(FastBlock)  # only explicit() and its three attributes are used
    torch.nn.Module.__init__(block)
    block.num_heads, block.head_dim, block.scores_bytes = h, d, fast_mod.SCORES_CHUNK_BYTES

    def torch_form() -> torch.Tensor:
        heads = scaled.view(B, T, 3, h, d).permute(2, 0, 3, 1, 4)
        return block.explicit(heads, B, T).transpose(1, 2).reshape(B * T, h * d)

    def sdpa() -> torch.Tensor:
        q, k, v = (t.contiguous() for t in scaled.view(B, T, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0))
        return F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).reshape(B * T, h * d)

    forms: dict[str, Callable[[], object]] = {"PyTorch GEMMs + softmax": torch_form, "SDPA (flash)": sdpa}
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention)
        heads = [t.contiguous() for t in scaled.view(B, T, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)]
        forms["flex_attention (inductor)"] = lambda: compiled(*heads, scale=1.0)
    if kernel is not None:
        forms = {"fused C kernel": lambda: kernel(qkv, B, h, d, d**-0.5), **forms}
    flops = 4.0 * B * h * T * T * d
    with torch.inference_mode():
        for form, fn in forms.items():
            ms = best_ms(fn)
            print(f"{name} one layer, b{B}: {form}: {ms:.2f} ms, {flops / ms / 1e6:.0f} GFLOP/s", flush=True)


def kernel_ab(name: str, batch: int, against: Path | None, int8: bool = False, repeats: int = 15) -> None:
    """One layer's attention: the kernel built from ``against`` and the current one, alternating call by call
    (``int8``: the int8 variant's; ``against`` None: the bf16 kernel against the int8 one, and each one's relative
    error from fp32 SDPA on the same bf16 q, k, v). Each writes into an output of its own allocated once: a fresh
    5 MB output per call is page-faulted anew or not depending on glibc's allocation history (0 or ~470 faults
    per call, up to +30% time), which would decide the comparison instead of the kernels."""
    if against is None:
        old, new = attention.load(), attention.load_int8()
    elif int8:
        source = native.kernel_source(against)  # (simd.h in front, as for the current one)
        old_lib = native.load(source, "vk_attention_int8_against", attention.INT8_FLAGS, attention.INT8_NEEDS)
        old = None if old_lib is None else attention.FusedAttention(old_lib, "vk_attention_int8")
        new = attention.load_int8()
    else:
        old_lib = native.load(against.read_text(), "vk_attention_against", attention.FLAGS, attention.NEEDS)
        old, new = (None if old_lib is None else attention.FusedAttention(old_lib)), attention.load()
    if old is None or new is None:
        print(f"{name}: a kernel could not be built on this machine")
        return
    kernels = {"against": old, "current": new} if against else {"bf16": old, "int8": new}
    cfg = create_model(name).cfg
    B, T, h, d = batch, cfg.num_tokens(), cfg.num_heads, cfg.hidden_size // cfg.num_heads
    qkv = torch.randn(B * T, 3 * h * d).to(torch.bfloat16)
    outs = {k: qkv.new_empty(B * T, h * d) for k in kernels}
    args = (B, T, h, d, qkv.stride(0), h * d, d**-0.5, torch.get_num_threads())
    fns = {k: functools.partial(fn.fn, qkv.data_ptr(), outs[k].data_ptr(), *args) for k, fn in kernels.items()}
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    time_alternating(fns, 2, cpu, threads)  # warm-up
    timings = time_alternating(fns, repeats, cpu, threads)
    flops = 4.0 * B * h * T * T * d
    line = ", ".join(
        f"{k} {min(t.times) * 1e3:.2f} ms (median {t.median * 1e3:.2f}, {flops / t.median / 1e9:.0f} GFLOP/s)"
        for k, t in timings.items()
    )
    a, b = timings.keys()
    ratio = timings[a].median / timings[b].median
    print(f"{name} one layer, b{B}: {line}; {b} / {a} speed {ratio:.3f}", flush=True)
    if against is not None:
        same = torch.equal(*outs.values())
        print(f"{name}: outputs {'equal bit for bit' if same else 'DIFFER'} between the two versions", flush=True)
    if against is None:  # the error of each from fp32 SDPA (inputs: rows of N(0, 1), like a LayerNorm's)
        q, k, v = qkv.float().view(B, T, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        ref = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5).transpose(1, 2).reshape(B * T, h * d)
        errs = {m: ((o.float() - ref).norm() / ref.norm()).item() for m, o in outs.items()}
        print(f"{name}: rel. err from fp32 SDPA: " + ", ".join(f"{m} {e:.2e}" for m, e in errs.items()), flush=True)


def alternate(
    fast: InferenceViT, kernel: object, x: torch.Tensor, repeats: int
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Seconds per call of ``fast`` with the kernel and with the torch attention, alternating call by call
    after 2 warm-up rounds; and each mode's final tokens."""
    outs: dict[str, torch.Tensor] = {}

    def run(mode: str) -> None:
        set_fused(fast, kernel if mode == "fused" else None)
        outs[mode] = fast.forward_features(x)  # (the official init's head is zero)

    fns = {mode: functools.partial(run, mode) for mode in ("fused", "torch")}
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    with torch.inference_mode():
        time_alternating(fns, 2, cpu, threads)  # warm-up
        timings = time_alternating(fns, repeats, cpu, threads)
    return {m: t.times for m, t in timings.items()}, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--precision", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layer", action="store_true", help="one layer's attention in isolation, three ways")
    ap.add_argument("--flex", action="store_true", help="with --layer: also flex_attention compiled by inductor")
    ap.add_argument("--against", type=Path, help="with --layer: the kernel built from this C source vs the current")
    ap.add_argument("--int8", action="store_true", help="with --layer: the bf16 kernel against the int8 one")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.models:
        if args.layer and (args.against or args.int8):
            kernel_ab(name, args.batch_size, args.against, args.int8)
            continue
        if args.layer:
            one_layer(name, args.batch_size, args.flex)
            continue
        model = create_model(name).eval()
        x = torch.randn(args.batch_size, 3, 224, 224)
        for precision in args.precision:
            fast = optimize_for_inference(model, batch_size=args.batch_size, int8=precision == "int8")
            assert isinstance(fast, InferenceViT)
            kernel = next(b.fused for b in fast.blocks if isinstance(b, FastBlock))
            if kernel is None:
                print(f"{name} {precision}: the fused kernel is not available on this machine")
                continue
            times, outs = alternate(fast, kernel, x, args.repeats)
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
