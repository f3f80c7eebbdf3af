"""The CPU training step's kernels chosen by measurement: ``choose_training_path(net, micro_batch, precision)``.

The training step on a CPU has three ways to run a block's attention and MLP:

- ``"c"``: the explicit softmax attention and vitkit's C kernels (``vitkit.train.kernels``: the whole attention
  forward/backward, GELU fused with its bias gradient, oneDNN GEMMs on reordered weights), bf16 on AVX512_BF16
  CPUs: the built-in choice there;
- ``"explicit"``: the explicit softmax attention in PyTorch's ops (the built-in choice elsewhere on CPU);
- ``"sdpa"``: PyTorch's fused attention (its CPU flash kernel) and PyTorch's ops.

They were measured on Zen 4/5 and on Xeons without usable AMX; on AMX Xeons oneDNN's tile kernels behind PyTorch's
own operators can win. So, as the inference engines do (:mod:`vitkit.inference.tune`), one block's forward and
backward at the run's micro-batch and precision is timed for each candidate, alternating call by call; an
alternative replaces the built-in choice only when ``MIN_GAIN`` times faster, a race the process did not get its
cores for decides nothing, and blocks under ``MIN_MEASURABLE_S`` (the digits job's) are not raced. A run's
seconds dwarf the race's; it is not cached.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vitkit.inference import tune as inference_tune
from vitkit.inference.tune import MIN_GAIN, MIN_MEASURABLE_S, Timer
from vitkit.models.kernel_api import TrainingKernels
from vitkit.models.kernel_paths import set_block_path
from vitkit.models.vit import Block, VisionTransformer, ViTConfig
from vitkit.train import kernels as cpu_kernels

EXPLICIT_ATTENTION_BYTES = 1 << 30  # attention "auto" on CPU: most probabilities the explicit kernel may keep


def explicit_attention(choice: str, device: torch.device, model: ViTConfig, micro_batch: int) -> bool:
    """Whether training steps run the explicit softmax attention (else the fused SDPA kernel; evaluation always
    runs the fused one). ``choice`` "auto": the explicit softmax on CPU, whose backward is faster than PyTorch's
    fused CPU kernel at every ViT length measured (17-577 tokens, BENCHMARKS.md), as long as the probabilities it
    keeps for the backward pass stay under EXPLICIT_ATTENTION_BYTES; the fused (flash) kernel on GPU and for long
    sequences."""
    if choice not in ("auto", "measure"):  # "measure": the rule is the race's built-in candidate
        return choice == "explicit"
    if device.type != "cpu":
        return False
    kept = micro_batch * model.num_heads * model.num_tokens() ** 2 * 4 * model.depth  # fp32 probabilities, all layers
    return kept <= EXPLICIT_ATTENTION_BYTES


@dataclass(frozen=True)
class TrainingPath:
    """What a CPU run's blocks use: explicit or fused attention, the C kernels or PyTorch's ops, and why."""

    explicit: bool
    kernels: TrainingKernels | None
    choice: str  # "c" | "explicit" | "sdpa", or "" for the built-in rule unraced
    times_ms: Mapping[str, float]
    source: str

    @property
    def changed(self) -> bool:
        """Whether the race replaced the built-in choice (the first one timed)."""
        return bool(self.times_ms) and self.choice != next(iter(self.times_ms))

    def describe(self) -> str:
        if not self.times_ms:
            return f"training kernels: {self.source}"
        times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        return f"training kernels {self.source}: {self.choice} ({times} ms per block step)"


def choose_training_path(
    net: VisionTransformer,
    micro_batch: int,
    precision: str,
    explicit_rule: bool,
    *,
    timer: Timer | None = None,
    load: Callable[[], TrainingKernels | None] = cpu_kernels.load,
) -> TrainingPath:
    """The fastest way to train ``net``'s blocks here (CPU). ``explicit_rule``: the built-in choice of attention
    (:func:`explicit_attention`); the race keeps it unless an alternative wins by ``MIN_GAIN``.
    ``timer``: how candidates are timed (default: :func:`vitkit.inference.tune.default_timer`)."""
    c = load()
    if not explicit_rule:  # the fused kernel: the explicit path's probabilities would not fit (long sequences)
        return TrainingPath(False, c, "sdpa", {}, "built-in rule")
    builtin = "c" if c is not None and precision == "bf16" else "explicit"  # the C kernels take bf16 tensors only
    built = {builtin: (True, c)}  # today's path, exactly: the explicit attention, the kernels handed over
    built |= {o: (o == "explicit", None) for o in ("explicit", "sdpa") if o != builtin}  # alternatives: PyTorch's ops
    # a fresh block of the model's shape (weights do not change the timing; the run's own may be sharded already);
    # the race draws from a forked generator, so the run's own random stream is what it would have been
    with torch.random.fork_rng(devices=[]):
        block = VisionTransformer(dataclasses.replace(net.cfg, depth=1, num_classes=0)).blocks[0]
        assert isinstance(block, Block)
        fns = {o: _block_step(block, micro_batch, net.cfg.num_tokens(), precision, *p) for o, p in built.items()}
        times = (timer or inference_tune.default_timer)(fns)
    if any(math.isnan(t) for t in times.values()):
        return TrainingPath(True, c, builtin, {}, "built-in rule (the machine was busy while racing)")
    if times[builtin] * 1e-3 < MIN_MEASURABLE_S:
        return TrainingPath(True, c, builtin, {}, "built-in rule (a block step is too small to race)")
    best = min(times, key=lambda k: times[k])
    winner = best if times[best] * MIN_GAIN <= times[builtin] else builtin
    return TrainingPath(*built[winner], winner, times, "measured")


def _block_step(
    block: Block, batch: int, tokens: int, precision: str, explicit: bool, kernels: TrainingKernels | None
) -> Callable[[], Any]:
    """One block's forward and backward on random tokens (B, T, D), as the step runs it."""
    one = copy.deepcopy(block).train()
    set_block_path(one, not explicit, kernels)
    x = torch.randn(batch, tokens, one.norm1.normalized_shape[0], requires_grad=True)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def step() -> None:
        with cast:
            y, _ = one(x)
        y.float().sum().backward()
        one.zero_grad(set_to_none=True)
        x.grad = None

    return step
