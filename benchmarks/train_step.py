"""A/B of training-step variants in one process: ViT-S/16, 224 px, batch 32, bf16 autocast, fused AdamW.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/train_step.py [--steps 8] [--variants old-attn new-attn]
    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/train_step.py --profile new-attn
    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/train_step.py --time-ops kernels

Every variant is the same model (same weights, same batch) trained the same way as ``vitkit bench --task
train``'s explicit-attention runner and the trainer (freed memory kept in the heap, ``heap_kept``); the
variants run one step each in turn, after a warm-up step each, and the median and best step times are
printed. Variants:

- ``old-attn``: the explicit attention through autograd (q scaled, ``softmax(q k^T) v``), as before the
  hand-written backward pass (``vitkit.models.attention``);
- ``new-attn``: the model's explicit path, ``softmax_attention`` (what the trainer runs on CPU);
- ``sdpa``: PyTorch's fused ``scaled_dot_product_attention``;
- ``compiled-blocks``: ``new-attn`` with every block ``torch.compile``'d (inductor);
- ``compiled-blocks-old-attn``: ``old-attn`` with every block compiled (inductor sees the whole formula);
- ``kernels``: ``new-attn`` with vitkit's training kernels (``vitkit.train.kernels``: fc1 + GELU with the
  fused GELU/bias-gradient backward, the whole attention forward and backward in C, the Linear layers'
  GEMMs through oneDNN on weights reordered once per pass), what the trainer
  runs on an AVX-512 BF16 CPU;
- ``kernels-aten-linear``: ``kernels`` with the Linear layers' forward and input-gradient GEMMs as ATen's
  ``addmm`` / ``mm`` on the plain weights (the trainer before the oneDNN GEMMs on reordered weights);
- ``kernels-fwd-gemm``: ``kernels`` with only the forward GEMMs through oneDNN, the input gradients'
  through ATen's ``mm`` (no reorder of W^T in the backward pass);
- ``kernels-no-attn``: ``kernels`` with the attention left to ``softmax_attention``'s GEMMs and only its
  softmax in C (the trainer before the C attention kernel);
- ``kernels-gelu`` / ``kernels-softmax``: one of the two elementwise kinds alone (no attention kernel).
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vitkit.models import create_model
from vitkit.models.vit import Attention, VisionTransformer
from vitkit.timing import time_alternating
from vitkit.train import kernels
from vitkit.train.heap import heap_kept


def _old_attention(self: Attention, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, None]:
    """The explicit path before ``softmax_attention``: autograd through the formula."""
    B, T, D = x.shape
    qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, h, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, h, T, d)
    logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, T, T)
    out = logits.softmax(dim=-1) @ v  # (B, h, T, d)
    return self.proj(out.transpose(1, 2).reshape(B, T, D)), None


def _with_old_attention(model: VisionTransformer) -> VisionTransformer:
    for m in model.modules():
        if isinstance(m, Attention):
            m.forward = types.MethodType(_old_attention, m)  # type: ignore[method-assign]
    return model


def _compiled_blocks(model: VisionTransformer) -> VisionTransformer:
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = torch.compile(blk)  # type: ignore[assignment]
    return model


def _with_kernels(
    model: VisionTransformer, gelu: bool = True, softmax: bool = True, attention: bool = True, linear: bool = True
) -> VisionTransformer:
    loaded = kernels.load(gelu=gelu, softmax=softmax, attention=attention, linear=linear)
    if loaded is None:
        raise SystemExit("the C training kernels cannot run here (no C compiler or no AVX-512 BF16)")
    model.set_training_kernels(loaded)
    return model


class _ForwardGemmOnly:
    """The loaded kernels, but the input gradient's GEMM (a transposed weight) as ATen's ``mm``."""

    def __init__(self, loaded: kernels.CpuTrainingKernels) -> None:
        self.loaded = loaded

    def __getattr__(self, name: str) -> object:
        return getattr(self.loaded, name)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if w.is_contiguous():
            return self.loaded.linear(x, w, b)
        return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())


def _forward_gemm_only(model: VisionTransformer) -> VisionTransformer:
    """``kernels`` with the input gradients' GEMMs as ATen's ``mm`` (no W^T reorder in the backward pass)."""
    loaded = kernels.load()
    assert loaded is not None
    model.set_training_kernels(_ForwardGemmOnly(loaded))  # type: ignore[arg-type]
    return model


VARIANTS: dict[str, Callable[[VisionTransformer], nn.Module]] = {
    "kernels-fwd-gemm": _forward_gemm_only,
    "old-attn": _with_old_attention,
    "new-attn": lambda m: m,
    "compiled-blocks": _compiled_blocks,
    "compiled-blocks-old-attn": lambda m: _compiled_blocks(_with_old_attention(m)),
    "sdpa": lambda m: m,
    "kernels": _with_kernels,
    "kernels-no-attn": lambda m: _with_kernels(m, attention=False),
    "kernels-aten-linear": lambda m: _with_kernels(m, linear=False),
    "kernels-gelu": lambda m: _with_kernels(m, softmax=False, attention=False),
    "kernels-softmax": lambda m: _with_kernels(m, gelu=False, attention=False),
}


class _OpTimer(TorchDispatchMode):
    """Wall time of every ATen op as dispatched (no profiler: nothing but a clock around each call)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.flops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.times[f"{func} {shapes}".replace(" ", "")].append(time.perf_counter() - start)
        self.flops[f"{func} {shapes}".replace(" ", "")] = _gemm_flops(str(func), shapes)
        return out

    def wrap_kernels(self) -> None:
        """Time the C kernels' calls (not ATen ops) by a clock around each (in this process, for good)."""
        for name in ("gelu", "gelu_backward_bias", "attention", "attention_backward"):
            fn = getattr(kernels.CpuTrainingKernels, name)

            def timed(*a, _fn=fn, _name=f"C:{name}", **kw):  # type: ignore[no-untyped-def]
                start = time.perf_counter()
                out = _fn(*a, **kw)
                self.times[_name].append(time.perf_counter() - start)
                return out

            setattr(kernels.CpuTrainingKernels, name, timed)


def _gemm_flops(op: str, shapes: tuple[tuple[int, ...], ...]) -> int:
    """2 M N K of a Linear GEMM (mm, addmm, oneDNN's linear) from its operands' shapes, else 0."""
    mats = [s for s in shapes if len(s) == 2]
    if "linear_pointwise" in op and len(mats) >= 2:  # x (M, K), weight (N, K)
        return 2 * mats[0][0] * mats[0][1] * mats[1][0]
    if op.startswith(("aten.mm.", "aten.addmm.")) and len(mats) >= 2:  # (M, K), (K, N)
        return 2 * mats[-2][0] * mats[-2][1] * mats[-1][1]
    return 0


def make_step(name: str, base: VisionTransformer, x: torch.Tensor, labels: torch.Tensor) -> Callable[[], float]:
    model = copy.deepcopy(base).train()
    model.set_fused_attention(name == "sdpa")
    fwd = VARIANTS[name](model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x).float(), labels)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["old-attn", "new-attn"], choices=sorted(VARIANTS))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (default 8)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="S/16")
    ap.add_argument("--profile", choices=sorted(VARIANTS), help="profile 3 steps of one variant, per op")
    ap.add_argument("--time-ops", choices=sorted(VARIANTS), help="time 3 steps of one variant per ATen op (clock only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = create_model(args.model, num_classes=1000)
    x = torch.randn(args.batch_size, 3, 224, 224)
    labels = torch.randint(0, 1000, (args.batch_size,))
    with heap_kept():
        if args.profile:
            step = make_step(args.profile, base, x, labels)
            for _ in range(2):
                step()
            with torch.profiler.profile() as prof:
                total = sum(step() for _ in range(3))
            print(f"{args.profile}: {total / 3 * 1e3:.0f} ms per step under the profiler")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            return
        if args.time_ops:
            timer = _OpTimer()
            timer.wrap_kernels()
            step = make_step(args.time_ops, base, x, labels)
            for _ in range(2):
                step()
            timer.times.clear()
            with timer:
                total = sum(step() for _ in range(3))
            print(f"{args.time_ops}: {total / 3 * 1e3:.0f} ms per step with the op timer")
            print("| op (operand shapes) | calls per step | ms per step | GFLOP/s |")
            print("|---|---|---|---|")
            for op, ts in sorted(timer.times.items(), key=lambda kv: -sum(kv[1]))[:40]:
                rate = f"{timer.flops[op] * len(ts) / sum(ts) / 1e9:.0f}" if timer.flops.get(op) else ""
                print(f"| {op} | {len(ts) // 3} | {sum(ts) / 3 * 1e3:.1f} | {rate} |")
            return
        steps = {name: make_step(name, base, x, labels) for name in args.variants}
        for step in steps.values():  # warm-up (and compilation)
            step()
        timings = time_alternating(steps, args.steps, torch.device("cpu"), torch.get_num_threads())
        times = {name: t.times for name, t in timings.items()}
    first = statistics.median(times[args.variants[0]])
    print(f"{args.model} batch {args.batch_size}, bf16 autocast, {args.steps} alternating steps per variant")
    print("| variant | median step (s) | best (s) | img/s (median) | vs first |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {min(ts):.3f} | {args.batch_size / med:.2f} | {first / med:.3f} |")


if __name__ == "__main__":
    main()
