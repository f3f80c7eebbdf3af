"""What the fast path does on a device when asked to choose: ``optimize_for_device(model, "auto")``.

:func:`plan_inference` is the decision alone (a function of the device's capabilities, testable without the
device): the serving dtype, whether to ``torch.compile`` and in which mode, and which of PyTorch's fused
attention kernels (SDPA backends) are candidates. :func:`optimize_for_device` applies it: on a CUDA GPU the
candidates are timed on the model's own attention shape and the fastest is kept for every call.

On the CPU the plan is the measured fast path of ``optimize_for_inference`` (eager, pre-packed weights,
vitkit's own attention kernels; bf16 where the CPU has bf16 instructions). On CUDA it is bf16 weights where the
GPU computes bf16, compiled (CUDA graphs, ``mode="reduce-overhead"``, for batches up to ``SMALL_BATCH``, where
launch overhead dominates), and the SDPA backend measured. The CUDA choices follow PyTorch's guidance and have
not yet been measured by vitkit on a GPU (BENCHMARKS.md, "GPU: what has not been measured").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vitkit import hardware
from vitkit.models.vit import VisionTransformer
from vitkit.timing import time_alternating

SMALL_BATCH = 8  # up to this batch, CUDA graphs ("reduce-overhead") when compiling on a GPU
SDPA = ("flash", "cudnn", "efficient", "math")  # PyTorch's fused attention kernels, by vitkit's names


@dataclass(frozen=True)
class InferencePlan:
    """How ``optimize_for_device`` runs a model on one device."""

    device: torch.device
    dtype: torch.dtype
    compile: bool
    compile_mode: str | None  # torch.compile's mode; None: its default
    sdpa_candidates: tuple[str, ...]  # timed on the model's attention shape; () = the fast path's own choice
    reason: str

    def describe(self) -> str:
        """One line: what runs and why."""
        what = f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
        if self.compile:
            what += f", torch.compile ({self.compile_mode or 'default'} mode)"
        if self.sdpa_candidates:
            what += f", attention: fastest of {'/'.join(self.sdpa_candidates)}"
        return f"{what} ({self.reason})"


def plan_inference(device: torch.device | str, precision: str = "auto", batch_size: int | None = None) -> InferencePlan:
    """The fast path's configuration for ``device``. ``precision``: "auto" (bf16 where the device computes it
    natively, else fp32), "bf16" or "fp32". ``batch_size``: the batch that will be served (small batches get
    CUDA graphs on a GPU)."""
    device = torch.device(device)
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    bf16 = precision == "bf16" or (precision == "auto" and hardware.has_native_bf16(device))
    dtype = torch.bfloat16 if bf16 else torch.float32
    if device.type != "cuda":
        return InferencePlan(
            device, dtype, False, None, (), "CPU: eager with pre-packed weights is faster than compiling here"
        )
    small = batch_size is not None and batch_size <= SMALL_BATCH
    # flash attention has no fp32 kernel; cuDNN's needs bf16/fp16 too
    candidates = ("flash", "cudnn", "efficient") if bf16 else ("efficient", "math")
    reason = "GPU: compiled" + (f", CUDA graphs for batches up to {SMALL_BATCH}" if small else "")
    return InferencePlan(device, dtype, True, "reduce-overhead" if small else None, candidates, reason)


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


@contextlib.contextmanager
def sdpa_backend(name: str | None) -> Iterator[None]:
    """PyTorch's ``scaled_dot_product_attention`` restricted to one backend inside (None: unrestricted)."""
    if name is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_backend(name)]):
        yield


def fastest_sdpa_backend(
    candidates: tuple[str, ...],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 5,
) -> tuple[str | None, dict[str, float]]:
    """Time each candidate backend on q, k, v of ``shape`` (B, heads, T, head_dim) and return the fastest with
    every candidate's median seconds; candidates the device cannot run for this shape and dtype are left out
    (None when none can)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(3))
    runnable = {}
    for name in candidates:
        fn = functools.partial(_sdpa, name, q, k, v)
        try:
            fn()
        except RuntimeError:  # "No available kernel" for this device, dtype or shape
            continue
        runnable[name] = fn
    if not runnable:
        return None, {}
    timings = time_alternating(runnable, repeats, device, torch.get_num_threads())
    medians = {k: t.median for k, t in timings.items()}
    return min(medians, key=medians.__getitem__), medians


def _sdpa(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), sdpa_backend(name):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


class PlannedModel(nn.Module):
    """The fast path with its plan: ``forward(images) -> logits`` with the chosen attention backend in force."""

    def __init__(self, fast: nn.Module, plan: InferencePlan, attention: str | None, timings: dict[str, float]):
        super().__init__()
        self.fast = fast
        self.plan = plan
        self.attention = attention  # the SDPA backend measured fastest (None: PyTorch's own choice)
        self.attention_timings = timings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sdpa_backend(self.attention):
            return self.fast(x)


def optimize_for_device(
    model: VisionTransformer, precision: str = "auto", batch_size: int | None = None
) -> PlannedModel:
    """``optimize_for_inference`` configured by :func:`plan_inference` for the device ``model`` is on; on a GPU
    the SDPA backend is measured on the model's attention shape (``batch_size``, default 32)."""
    from vitkit.inference.fast import optimize_for_inference

    device = next(model.parameters()).device
    plan = plan_inference(device, precision, batch_size)
    fast = optimize_for_inference(
        model, plan.dtype, compile=plan.compile, compile_mode=plan.compile_mode, batch_size=batch_size
    )
    attention: str | None = None
    timings: dict[str, float] = {}
    if plan.sdpa_candidates:
        cfg = model.cfg
        shape = (batch_size or 32, cfg.num_heads, cfg.num_tokens(), cfg.hidden_size // cfg.num_heads)
        attention, timings = fastest_sdpa_backend(plan.sdpa_candidates, shape, plan.dtype, device)
    return PlannedModel(fast, plan, attention, timings)
