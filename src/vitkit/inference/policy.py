"""One home for what runs where: the inference engine's plan, training's precision, the feature cache's
precisions and ``vitkit bench``'s defaults, decided from the device's capabilities (``vitkit.hardware``) before
any model is built, and testable with those capabilities faked.

:func:`plan_engine` is the engine's plan (:class:`EnginePlan`): one of three paths --

- ``reference``: an explicit ``fp32`` on vitkit's own backend: the checkpoint's own model, bit for bit, with
  images decoded at full scale;
- ``plain``: ``auto`` landing on fp32 where the fp32 fast path does not pay (:func:`fp32_fast_path_pays`): the
  model itself, images decoded at reduced scale;
- ``fast``: a fast copy (vitkit's fast path, fp8, or an ONNX engine), images decoded at reduced scale --

with the precision ``auto`` resolves to (:func:`resolve_precision`), its floating-point dtype, the device, and on
a CUDA GPU the PyTorch attention kernels (SDPA backends) to time on the model's attention shape and, when asked
for, ``torch.compile`` (CUDA graphs for batches up to ``SMALL_BATCH``). The two measurements the decisions need
live here too: whether bf16 beats fp32 on this CPU (:func:`bf16_is_faster`) and the fastest SDPA backend
(:func:`fastest_sdpa_backend`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vitkit import hardware
from vitkit.errors import ConfigError
from vitkit.inference.fp8 import fp8_unsupported
from vitkit.timing import time_alternating

BACKENDS = ("torch", "onnxruntime", "openvino", "auto")  # vitkit's fast path, the ONNX engines, the fastest of them
PRECISIONS = ("auto", "fp32", "bf16", "int8", "fp8")  # the engine's (predict, eval, serve, ...)
FEATURE_PRECISIONS = ("fp32", "bf16", "int8")  # the feature cache's: fp32 the model itself; bf16, int8 the fast path
SMALL_BATCH = 8  # up to this batch, CUDA graphs ("reduce-overhead") when compiling on a GPU
SDPA = ("flash", "cudnn", "efficient", "math")  # PyTorch's fused attention kernels, by vitkit's names
BF16_MIN_SPEEDUP = 1.2  # bf16 must beat fp32 by this much to be chosen by --precision auto (it also rounds more)
# a training run's validation pass of at least this many tokens (images x tokens per image) runs on the inference
# fast path, packed from the current weights; smaller ones on the model itself (see validation_plan)
VALIDATION_FAST_TOKENS = 20_000


def engine_device(backend: str, device: torch.device | str) -> torch.device:
    """The device an engine on ``backend`` runs on: ``device`` (a name, ``auto``: this process's GPU where there is
    one) for vitkit's own path; the CPU for ONNX Runtime and OpenVINO (``auto`` included), which run on the CPU
    only (ConfigError for another device, and for an unknown backend). The one rule of where an engine runs."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if isinstance(device, str):  # "auto": this process's GPU when there is one (the engines: the CPU)
        device = hardware.resolve_device("cpu" if backend != "torch" and device == "auto" else device)
    if backend != "torch" and device.type != "cpu":
        raise ConfigError(f"--backend {backend}: the engines run on the CPU, not {device}")
    return device


def fp32_fast_path_pays(device: torch.device | str = "cpu") -> bool:
    """Whether the fp32 fast path (pre-packed oneDNN GEMMs, chunked attention and MLP) runs faster than the
    model's own forward on ``device``: on CPUs with AVX-512 (B/16 and S/16 at batch 32 on an Intel Xeon of family
    6 model 207: 1.17x), and on GPUs; not on AVX2-only CPUs, where it measured 0.91x (Ti/16 at batch 8,
    BENCHMARKS.md, "CPUs without AVX-512")."""
    return torch.device(device).type != "cpu" or "avx512f" in hardware.cpu_flags()


def bf16_is_faster(device: torch.device | str = "cpu", repeats: int = 3) -> bool:
    """Whether bf16 matmuls are native on ``device`` and faster than fp32 ones: what ``--precision auto``
    asks. CUDA: where bf16 is supported. CPU: with bf16 instructions (:func:`vitkit.hardware.has_native_bf16`),
    when a GEMM of ViT-B's MLP shape (512 x 768 by 768 x 3072, 2.4 GFLOP) runs at least ``BF16_MIN_SPEEDUP``
    times faster in bf16 than in fp32, timed now (best of ``repeats``, alternating; ~0.1 s). Native is not
    enough: CPUs with AVX512_BF16 but no AMX may issue bf16 dot products on fewer ports than fp32 FMAs, and then
    bf16 runs slower (an Intel Xeon of family 6 model 207: 165 against 280 GFLOP/s, BENCHMARKS.md), while AMD
    Zen 4/5 run it at twice the fp32 rate."""
    device = torch.device(device)
    if not hardware.has_native_bf16(device):
        return False
    if device.type != "cpu":
        return True
    a, w = torch.randn(512, 768), torch.randn(3072, 768)
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        fns = {"fp32": functools.partial(linear, a, w), "bf16": functools.partial(linear, a.bfloat16(), w.bfloat16())}
        for fn in fns.values():
            fn()  # warm-up: oneDNN creates its primitive
        timings = time_alternating(fns, repeats, device, torch.get_num_threads())
    return min(timings["fp32"].times) >= BF16_MIN_SPEEDUP * min(timings["bf16"].times)


def resolve_precision(precision: str, device: torch.device | str = "cpu", backend: str = "torch") -> str:
    """``auto`` -> ``bf16`` where bf16 matmuls are native and faster than fp32 ones on ``device``
    (``vitkit.inference.policy.bf16_is_faster``), else ``fp32``; ONNX Runtime (no bf16 kernels) -> ``fp32``.
    Other precisions are returned as they are (ConfigError for an unknown one, and for fp8 where it cannot run)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if precision == "fp8":
        reason = "fp8 runs on vitkit's own path (--backend torch)" if backend != "torch" else fp8_unsupported(device)
        if reason:
            raise ConfigError(f"--precision fp8: {reason}")
    if precision != "auto":
        return precision
    if backend == "onnxruntime":
        return "fp32"
    return "bf16" if bf16_is_faster(device) else "fp32"


def fast_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The floating-point dtype the fast path computes ``precision`` in: bf16 for bf16 and fp8 (its non-fp8
    parts); for int8 the parts around the int8 GEMMs in bf16 where ``device`` computes it natively (the VNNI GEMM
    writes bf16), else fp32; fp32 otherwise."""
    if precision == "int8":
        return torch.bfloat16 if hardware.has_native_bf16(device) else torch.float32
    return torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32


def train_precision(choice: str, device: torch.device) -> str:
    """The precision a training run computes in: ``choice`` "fp32" or "bf16" as given; "auto" bf16 autocast on a
    CUDA GPU that computes bf16 natively (Ampere and later), fp32 elsewhere (on CPUs fp32 is vitkit's measured
    default)."""
    if choice != "auto":
        return choice
    return "bf16" if device.type == "cuda" and hardware.has_native_bf16(device) else "fp32"


def bench_precisions(task: str, device: torch.device | str) -> tuple[str, ...]:
    """What ``vitkit bench`` measures without ``--precision``: bf16 where ``device`` computes it natively (pure
    bf16 weights for inference; autocast over fp32 master weights for a training step, as ``vitkit train
    --precision bf16`` runs), else fp32."""
    if not hardware.has_native_bf16(device):
        return ("fp32",)
    return ("bf16",) if task == "inference" else ("bf16-autocast",)


@dataclass(frozen=True)
class EnginePlan:
    """What an :class:`~vitkit.inference.engine.InferenceEngine` will run, decided once, before anything is decoded
    or built (:func:`plan_engine`), from the request and the machine: a job's transform (:attr:`full_decode`,
    :attr:`feeds_gpu`), its decoding workers and its engine all read it. The engine, once built, holds the plan
    with what building measured filled in (``backend`` as chosen by ``auto``, ``kernels``, ``plain_model``,
    ``attention``), which :meth:`describe` prints."""

    path: str  # "reference", "plain" or "fast"
    precision: str  # resolved: fp32, bf16, int8 or fp8
    requested: str  # as asked ("auto" included)
    backend: str
    device: torch.device
    dtype: torch.dtype  # the floating-point dtype of the path
    sdpa_candidates: tuple[str, ...] = ()  # CUDA: timed on the model's attention shape; (): PyTorch's own choice
    compile: bool = False
    compile_mode: str | None = None  # torch.compile's mode; None: its default
    # filled in when the engine is built (InferenceEngine.plan):
    kernels: str | None = None  # the CPU kernel races' choice (vitkit.inference.tune.Tuning.summary); None: not run
    plain_model: bool = False  # the races found the plain model (in ``dtype``) faster: it runs, not the fast path
    attention: str | None = None  # CUDA: the SDPA backend measured fastest (None: PyTorch's own choice)

    @property
    def full_decode(self) -> bool:
        """Whether JPEGs must be decoded at full scale: for the reference only. Every other path may decode at
        reduced scale (the same pixels within resampling error; see
        :class:`vitkit.data.eval_transform.EvalTransform`)."""
        return self.path == "reference"

    @property
    def feeds_gpu(self) -> bool:
        """Whether the engine runs on a CUDA device (the ONNX engines never do: :func:`engine_device`). A job's
        batches are then uint8 pixels (``EvalTransform(uint8=True)``), copied to the GPU straight from the workers'
        pageable shared memory and normalised there, and its decoding workers take every core but one
        (:func:`vitkit.data.stream.default_workers`). Not page-locked first (a DataLoader's ``pin_memory=True``): on
        an H100 the DataLoader's pinning thread took 54 ms a batch of 256 and an 8,192-image eval was 1.0-1.2 s
        slower with it in each of three pairs (BENCHMARKS.md, "GPU"). On the CPU the workers keep normalising:
        normalising a batch in the job's process measured 2.6x the workers' per-image cost there (a fresh 154 MB
        float batch faults in every page), and it would take the model's cores."""
        return self.device.type == "cuda"

    def on(self, device: torch.device) -> EnginePlan:
        """The same request planned for ``device`` (a ``torchrun`` process's own GPU); this plan when it is there."""
        if device == self.device:
            return self
        return plan_engine(
            self.requested, self.backend, device, fp32_reference=self.path == "reference" or self.requested != "fp32",
            batch_size=SMALL_BATCH if self.compile_mode == "reduce-overhead" else None, compile=self.compile,
        )  # fmt: skip

    def describe(self) -> str:
        """One line: ``--precision auto -> bf16; bf16 fast path on cpu``, with what building measured (the kernel
        races' choice, the plain model where it won, the fastest SDPA backend)."""
        auto = f"--precision auto -> {self.precision}; " if self.requested == "auto" else ""
        return f"{auto}{self._what()} on {self.device}"

    def _what(self) -> str:
        if self.path == "reference":
            return "fp32 reference (the checkpoint's own model)"
        if self.path == "plain":
            return "fp32, the checkpoint's own model (the fp32 fast path is slower on this CPU)"
        if self.backend != "torch":
            return f"{self.precision} on {self.backend}"
        if self.plain_model:
            return f"{self.precision}, {self.kernels}"
        what = f"{self.precision} fast path"
        if self.kernels is not None:
            what += f" ({self.kernels})"
        if self.compile:
            what += f", torch.compile ({self.compile_mode or 'default'} mode)"
        if self.attention:
            what += f", attention: {self.attention} (measured)"
        elif self.sdpa_candidates:
            what += f", attention: fastest of {'/'.join(self.sdpa_candidates)}"
        return what


def plan_engine(
    precision: str = "auto",
    backend: str = "torch",
    device: torch.device | str = "cpu",
    *,
    fp32_reference: bool = True,
    batch_size: int | None = None,
    compile: bool = False,
) -> EnginePlan:
    """The engine's plan for ``precision`` on ``backend`` and ``device`` (a name, ``auto``: this process's GPU
    where there is one, the CPU for the ONNX engines: :func:`engine_device`). ``fp32_reference=False`` runs an
    explicit ``fp32`` on the fp32 fast path instead of the model itself (a training run's validation pass).
    ``compile``: ``torch.compile`` the fast path where that is the choice (CUDA GPUs; with CUDA graphs for
    ``batch_size`` up to ``SMALL_BATCH``); on a CPU the eager pre-packed path is faster. ConfigError for an
    unknown backend or precision and for a combination that cannot run."""
    device = engine_device(backend, device)
    resolved = resolve_precision(precision, device, backend)
    path = "fast"
    if backend == "torch" and precision == "fp32" and fp32_reference:  # the reference: known before anything runs
        path = "reference"
    elif backend == "torch" and precision == "auto" and resolved == "fp32" and not fp32_fast_path_pays(device):
        path = "plain"
    dtype = fast_dtype(resolved, device) if path == "fast" else torch.float32
    gpu = path == "fast" and backend == "torch" and device.type == "cuda"
    # flash attention has no fp32 kernel; cuDNN's needs bf16/fp16 too
    candidates = (("flash", "cudnn", "efficient") if dtype == torch.bfloat16 else ("efficient", "math")) if gpu else ()
    small = batch_size is not None and batch_size <= SMALL_BATCH
    mode = "reduce-overhead" if compile and gpu and small else None
    return EnginePlan(path, resolved, precision, backend, device, dtype, candidates, compile and gpu, mode)


def validation_plan(
    precision: str,
    device: torch.device,
    tokens: int,
    *,
    processes: int = 1,
    compile: bool = False,
    batch_size: int | None = None,
) -> EnginePlan | None:
    """The engine of a training run's validation pass of ``tokens`` (images x tokens per image), or None for the
    training model itself. One process on the CPU (not compiled), and a pass of at least
    ``VALIDATION_FAST_TOKENS``: the fast path packed from the current weights, in fp32 for an fp32 run (the
    model's function up to fp32 rounding; ``precision`` the run's), for a bf16 run in bf16 where that is native
    and faster than fp32 (else fp32). Packing the weights costs about what the fast path saves on ~12,000 tokens
    (B/16 and S/16 at 224 px, 64 images: 0.98-0.99x the model's own pass; the default digits job's 5,700: 1.51x;
    BENCHMARKS.md, benchmarks/validation_pass.py), so smaller passes keep the model."""
    if tokens < VALIDATION_FAST_TOKENS or processes > 1 or device.type != "cpu" or compile:
        return None
    chosen = "fp32" if precision == "fp32" else resolve_precision("auto", device)
    return plan_engine(chosen, "torch", device, fp32_reference=False, batch_size=batch_size)


@contextlib.contextmanager
def sdpa_backend(name: str | None) -> Iterator[None]:
    """PyTorch's ``scaled_dot_product_attention`` restricted to one backend inside (None: unrestricted)."""
    if name is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    with sdpa_kernel([dict(zip(SDPA, kinds, strict=True))[name]]):
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
