"""Timing, memory and agreement measurement for ``vitkit bench``.

Every runner is timed in the same process, the runners alternating call by call (so a slowdown of the
machine hits all of them alike and the ratios stay robust), after warm-up calls; the report gives the
median, the inter-quartile range and the best time, the share of the CPU the process actually got during
the timed calls (below ~0.9: something else was running), peak memory, achieved FLOP/s and the fraction of
a peak rate measured in the same run (``vitkit.bench.peak``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitkit import hardware
from vitkit.bench.engines import SETTLE_S, check_engines, engine_models, engines_in
from vitkit.bench.measure import peak_memory
from vitkit.bench.peak import Peak, measure_peak
from vitkit.bench.report import add_ratios
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.inference import optimize_for_inference
from vitkit.inference.backends import EngineModel
from vitkit.inference.policy import fast_dtype
from vitkit.inference.tune import build_fast
from vitkit.models.cost import cost_table
from vitkit.models.kernel_paths import set_fused_attention, set_training_kernels
from vitkit.models.vit import VisionTransformer
from vitkit.timing import Timing, synchronize, time_alternating
from vitkit.train import kernels
from vitkit.train.heap import heap_kept
from vitkit.train.optim import adam_kernel
from vitkit.train.parallel import checkpoint_activations

PRECISIONS = ("fp32", "bf16-autocast", "bf16", "int8")
TASKS = ("inference", "train")
PEERS = ("transformers", "onnxruntime", "openvino")
_PEAK_KIND = {"fp32": "fp32", "bf16-autocast": "bf16", "bf16": "bf16", "int8": "int8"}  # precision -> peak


# ---- what is benchmarked --------------------------------------------------------------------------------


@dataclass
class BenchSpec:
    """One benchmark: a model at a resolution and batch, a task, precisions, runners and peers."""

    model: str = "Ti/16"  # variant name, or a checkpoint path
    image_size: int = 224
    batch_size: int = 8
    task: str = "inference"  # "inference" | "train"
    precisions: tuple[str, ...] = ("bf16",)
    compile: bool = False
    fast: bool = True  # include vitkit's inference fast path (inference only)
    compare: tuple[str, ...] = ()  # peers: "transformers", "onnxruntime", "openvino"
    grad_checkpointing: bool = False  # train: also run with activation checkpointing
    warmup: int = 1
    repeats: int = 5
    latency: bool = True  # inference: also time batch 1
    real_images: bool = False  # inference: also measure agreement with fp32 on real photos and digits
    device: str = "cpu"
    seed: int = 0
    num_classes: int | None = None  # None: the checkpoint's, or 1000 for a variant

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for p in self.precisions:
            if p not in PRECISIONS:
                raise ConfigError(f"--precision must be among {', '.join(PRECISIONS)}, got {p!r}")
            if self.task == "train" and p not in ("fp32", "bf16-autocast"):
                raise ConfigError(f"training runs in fp32 or bf16-autocast, not {p!r}")
            if p == "int8" and self.device != "cpu":
                raise ConfigError("int8 inference is supported on CPU only")
        for peer in self.compare:
            if peer not in PEERS:
                raise ConfigError(f"--compare supports {', '.join(PEERS)}, got {peer!r}")
        if self.repeats < 1 or self.warmup < 0 or self.batch_size < 1:
            raise ConfigError("--repeats and --batch-size must be positive, --warmup non-negative")


@dataclass
class Runner:
    """A named way of running the model: ``step()`` does one timed unit of work on the batch."""

    name: str
    impl: str  # "vitkit" | "vitkit-fast" | "transformers" | "onnxruntime" | "openvino"
    precision: str
    step: Callable[[], Any]
    output: Callable[[torch.Tensor], torch.Tensor] | None = None  # inference: logits for given images
    latency_step: Callable[[], Any] | None = None
    first_call_s: float = float("nan")
    info: dict[str, Any] = field(default_factory=dict)


def build_model(spec: BenchSpec) -> tuple[VisionTransformer, Preprocess]:
    """The vitkit model and its preprocessing: a checkpoint when ``spec.model`` names one, else a fresh
    variant whose head is given random (non-zero) weights so that outputs and top-1 agreement mean
    something."""
    from vitkit.checkpoints import loaded_from

    torch.manual_seed(spec.seed)
    loaded = loaded_from(spec.model, image_size=spec.image_size, num_classes=spec.num_classes)
    model, pre = loaded.model, replace(loaded.meta.preprocess, image_size=(spec.image_size, spec.image_size))
    if loaded.meta.format == "variant" and isinstance(model.head, nn.Linear):
        with torch.no_grad():
            nn.init.normal_(model.head.weight, std=model.cfg.hidden_size**-0.5)
    return model.to(spec.device).eval(), pre


def flops_per_image(model: VisionTransformer, image_size: int) -> float:
    """Forward FLOPs of one image (2 per multiply-add), from ``cost_table``."""
    return 2.0 * sum(r.macs for r in cost_table(model, (image_size, image_size)))


def _autocast(precision: str, device: torch.device) -> Any:
    if precision == "bf16-autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _as_precision(module: nn.Module, precision: str) -> nn.Module:
    """A copy of module in the precision's weights: bf16 casts, int8 quantises Linear layers dynamically."""
    module = copy.deepcopy(module)
    if precision == "bf16":
        return module.to(torch.bfloat16)
    if precision == "int8":  # what a transformers user would do: torch.ao's dynamic quantisation (FBGEMM)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's quantized tensors are deprecated in favour of PT2E
            return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)
    return module


def _compiled(module: nn.Module, task: str) -> nn.Module:
    options: dict[str, Any] = {}
    if task == "inference" and next(module.parameters()).device.type == "cpu":
        options["freezing"] = True  # inductor folds the frozen weights and pre-packs them for oneDNN
    return torch.compile(module, options=options or None)  # type: ignore[return-value]


def _logits_fn(module: nn.Module, hf: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda x: module(pixel_values=x).logits) if hf else module


def inference_runners(spec: BenchSpec, model: VisionTransformer, x: torch.Tensor) -> list[Runner]:
    """Every (implementation, precision) pair to time for inference."""
    device = x.device
    peers: dict[str, nn.Module] = {}
    if "transformers" in spec.compare:
        from vitkit.bench.peers import to_transformers

        peers["transformers"] = to_transformers(model)
    runners = []
    for precision in spec.precisions:
        impls: list[tuple[str, nn.Module, bool]] = [("vitkit", model, False)]
        impls += [(name, peer, True) for name, peer in peers.items()]
        for impl, base, hf in impls:
            module = _as_precision(base, precision)
            if spec.compile:
                module = _compiled(module, "inference")
            fn = _logits_fn(module, hf)
            runners.append(_inference_runner(impl, precision, fn, x, spec))
        if spec.fast and precision != "bf16-autocast" and not (precision == "int8" and device.type != "cpu"):
            dtype = fast_dtype(precision, device)  # as the engines: int8's other parts bf16 where native
            if device.type == "cpu":  # what the engines run: kernels (or the plain model) chosen by measurement
                fast, tuning = build_fast(model, dtype, spec.batch_size, precision == "int8")
            else:
                fast, tuning = optimize_for_inference(model, dtype, batch_size=spec.batch_size), None
            runner = _inference_runner("vitkit-fast", precision, fast, x, spec)
            if tuning is not None:
                runner.info["kernels"] = tuning.to_dict() | {"source": tuning.source, "describe": tuning.describe()}
            runners.append(runner)
    return runners


def _inference_runner(impl: str, precision: str, fn: Callable, x: torch.Tensor, spec: BenchSpec) -> Runner:
    device = x.device
    # bf16 weights take bf16 images; the fast path casts for itself (the images are float32: x.to(float32) is x)
    dtype = torch.bfloat16 if precision == "bf16" and impl != "vitkit-fast" else torch.float32
    xin = x.to(dtype)
    x1 = xin[:1].clone()

    def call(images: torch.Tensor) -> Any:
        with torch.no_grad(), _autocast(precision, device):
            return fn(images)

    def output(images: torch.Tensor) -> torch.Tensor:
        return call(images.to(dtype)).float()

    name = f"{impl}{'+compile' if spec.compile and impl != 'vitkit-fast' else ''} [{precision}]"
    return Runner(name, impl, precision, lambda: call(xin), output, lambda: call(x1))


def _engine_runner(fn: EngineModel, x: torch.Tensor) -> Runner:
    """An ONNX Runtime / OpenVINO model (``vitkit.bench.engines``) as a runner: float images in, logits out."""
    x1 = x[:1].clone()
    name = f"{fn.backend} [{fn.precision}]"
    return Runner(name, fn.backend, fn.precision, lambda: fn(x), fn, lambda: fn(x1), info={"engine": fn.detail})


def train_runners(spec: BenchSpec, model: VisionTransformer, x: torch.Tensor) -> list[Runner]:
    """One training step (forward, cross-entropy, backward, fused AdamW) per (implementation, precision).

    Each implementation also runs with its explicit-softmax attention (vitkit ``set_fused_attention(m, False)``,
    transformers ``attn_implementation="eager"``): on CPU its backward beats the fused kernel's at ViT's
    sequence lengths. With ``grad_checkpointing`` every variant also runs with activation checkpointing.
    """
    device = x.device
    labels = torch.randint(0, model.cfg.num_classes, (x.shape[0],), device=device)
    # (impl, module, is_transformers, tag): the fused-attention variant first
    variants: list[tuple[str, nn.Module, bool, str]] = []
    for fused in (True, False):
        m = copy.deepcopy(model)
        set_fused_attention(m, fused)
        if device.type == "cpu" and not spec.compile:  # the C training kernels, as the trainer (None: PyTorch's)
            set_training_kernels(m, kernels.load())
        variants.append(("vitkit", m, False, "" if fused else "+math-attn"))
    if "transformers" in spec.compare:
        from vitkit.bench.peers import to_transformers

        variants.append(("transformers", to_transformers(model, "sdpa"), True, ""))
        variants.append(("transformers", to_transformers(model, "eager"), True, "+eager-attn"))
    runners = []
    for precision in spec.precisions:
        for ckpt in (False, True) if spec.grad_checkpointing else (False,):
            for impl, base, hf_impl, tag in variants:
                module = copy.deepcopy(base).train()
                params = list(module.parameters())
                if ckpt and hf_impl:
                    enable = getattr(module, "activation_checkpointing_enable", None)  # transformers >= 5.x
                    (enable or module.gradient_checkpointing_enable)()  # type: ignore[operator]
                forward_module: nn.Module = checkpoint_activations(module) if ckpt and not hf_impl else module
                if spec.compile:
                    forward_module = _compiled(forward_module, "train")
                fn = _logits_fn(forward_module, hf_impl)
                # fused AdamW where PyTorch has it: vitkit's trainer and transformers' Trainer (its default
                # optim "adamw_torch_fused" with torch >= 2.8) both use it
                kernel = adam_kernel([{"params": params}])
                opt = torch.optim.AdamW(
                    params, lr=1e-4, weight_decay=0.05, fused=kernel.get("fused"), foreach=kernel.get("foreach")
                )
                runners.append(
                    _train_runner(impl, precision, fn, opt, x, labels, spec, tag + ("+ckpt" if ckpt else ""))
                )
    return runners


def _train_runner(
    impl: str,
    precision: str,
    fn: Callable,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    labels: torch.Tensor,
    spec: BenchSpec,
    tag: str,
) -> Runner:
    losses: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(precision, x.device):
            loss = F.cross_entropy(fn(x).float(), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    name = f"{impl}{'+compile' if spec.compile else ''}{tag} [{precision}]"
    return Runner(name, impl, precision, step, info={"losses": losses, "checkpointing": "+ckpt" in tag})


# ---- the benchmark -----------------------------------------------------------------------------------


def _batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([fn(x[i : i + batch]) for i in range(0, x.shape[0], batch)])


def _agreement(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_err": rel, "top1_agreement": top1}


def run_bench(spec: BenchSpec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one benchmark and return the results as a JSON-ready dict (see ``report.format_report``).

    Training steps run with freed memory kept in the heap, as ``vitkit train`` runs them (``heap_kept``),
    for every runner alike: the ratios compare the steps' kernels, not the allocator."""
    spec.validate()
    with heap_kept() if spec.task == "train" else contextlib.nullcontext():
        return _run_bench(spec, progress)


def _run_bench(spec: BenchSpec, progress: Callable[[str], None] | None) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    device, model, pre, x = _set_up(spec)
    fpi = flops_per_image(model, spec.image_size)
    say("measuring peak")
    peaks = _peaks(spec, model, device)
    say("building runners")
    runners = inference_runners(spec, model, x) if spec.task == "inference" else train_runners(spec, model, x)
    runners += [_engine_runner(m, x) for m in engine_models(spec.compare, spec.precisions, model, pre)]
    timings, latencies = _time(spec, runners, device, say)
    say("measuring peak again")
    peaks = _peaks(spec, model, device, before=peaks)
    reference, real = _references(spec, model, pre, x)
    rows = []
    for r in runners:
        say(f"memory {r.name}")
        row = _row(spec, r, timings[r.name], fpi, peaks[_PEAK_KIND[r.precision]], device)
        if r.name in latencies:
            row["latency_b1_ms"] = 1e3 * latencies[r.name].median
        if reference is not None and r.output is not None:
            row["agreement_vs_fp32"] = _agreement(r.output(x), reference)
        if real is not None and r.output is not None:
            say(f"real images {r.name}")
            row["agreement_real_images"] = _agreement(_batched(r.output, real[0], spec.batch_size), real[1])
            row["agreement_real_images"]["images"] = real[0].shape[0]
        rows.append(row)
    add_ratios(rows)
    vendor = _vendor_peaks(device, peaks)
    for row in rows:
        kind = _PEAK_KIND[row["precision"]]
        if kind in vendor:
            row["fraction_of_vendor_peak"] = row["achieved_flops"] / vendor[kind]["flops"]
    return {
        "spec": asdict(spec),
        "machine": machine_info(device),
        "date": time.strftime("%Y-%m-%d"),
        "model_name": model.cfg.name or spec.model,
        "tokens": model.cfg.num_tokens(spec.image_size),
        "gflops_per_image": fpi / 1e9,
        "flops_per_step": "3x forward (model FLOPs)" if spec.task == "train" else "forward",
        "peaks": {k: v.to_dict() for k, v in peaks.items()},
        "vendor_peaks": vendor,
        "results": rows,
    }


def _set_up(spec: BenchSpec) -> tuple[torch.device, VisionTransformer, Preprocess, torch.Tensor]:
    """(device, model, preprocessing, the timed batch); fails early on a peer that cannot run the spec."""
    device = hardware.resolve_device(spec.device)
    model, pre = build_model(spec)
    if spec.compare and "transformers" in spec.compare:
        from vitkit.bench.peers import transformers_config

        transformers_config(model)  # fail early, naming what transformers cannot represent
    check_engines(spec.compare, spec.precisions, spec.task, spec.device)
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(spec.batch_size, model.cfg.in_channels, spec.image_size, spec.image_size, generator=gen)
    return device, model, pre, x.to(device)


def _peaks(
    spec: BenchSpec, model: VisionTransformer, device: torch.device, before: dict[str, Peak] | None = None
) -> dict[str, Peak]:
    """The peak rate of each kind the precisions need; measured again after the timing (``before``), a busy
    machine only lowers a reading: the higher one is kept."""
    shapes = gemm_shapes(model, spec.batch_size, spec.image_size)
    peaks: dict[str, Peak] = {}
    for kind in before or dict.fromkeys(_PEAK_KIND[p] for p in spec.precisions):
        peaks[kind] = measure_peak(kind, device, gemm_shapes=shapes)
        if before is not None and before[kind].flops >= peaks[kind].flops:
            peaks[kind] = before[kind]
    return peaks


def _time(
    spec: BenchSpec, runners: list[Runner], device: torch.device, say: Callable[[str], None]
) -> tuple[dict[str, Timing], dict[str, Timing]]:
    """(timings, latencies at batch 1) of the runners, alternating call by call, after the warm-up calls (the
    first includes compilation / lazy packing: ``first_call_s``)."""
    for r in runners:
        say(f"warm-up {r.name}")
        for i in range(max(spec.warmup, 1 if spec.compile else 0)):
            synchronize(device)
            t0 = time.perf_counter()
            r.step()
            synchronize(device)
            if i == 0:
                r.first_call_s = time.perf_counter() - t0
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    settle = SETTLE_S if engines_in(spec.compare) else 0.0
    say(f"timing {len(runners)} runners x {spec.repeats} repeats")
    timings = time_alternating({r.name: r.step for r in runners}, spec.repeats, device, threads, settle)
    if spec.task != "inference" or not spec.latency:
        return timings, {}
    say("latency at batch 1")
    lat_fns: dict[str, Callable[[], Any]] = {r.name: r.latency_step for r in runners if r.latency_step is not None}
    for fn in lat_fns.values():
        fn()
    return timings, time_alternating(lat_fns, max(spec.repeats, 5), device, threads, settle)


def _references(
    spec: BenchSpec, model: VisionTransformer, pre: Preprocess, x: torch.Tensor
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Inference: fp32 vitkit's logits on the timed batch, and (images, logits) on real images when asked for."""
    if spec.task != "inference":
        return None, None
    with torch.inference_mode():
        reference = model(x).float()
        if not spec.real_images:
            return reference, None
        from vitkit.bench.sample_images import real_image_batch

        images = real_image_batch(pre).to(x.device)
        return reference, (images, _batched(lambda t: model(t).float(), images, spec.batch_size))


def _row(spec: BenchSpec, r: Runner, t: Timing, fpi: float, peak: Peak, device: torch.device) -> dict[str, Any]:
    """A runner's throughput, FLOP/s against the peak, and memory."""
    flop_factor = 1.0 if spec.task == "inference" else 3.0  # a training step: forward + 2x for backward
    flops = flop_factor * fpi * spec.batch_size / t.median
    return {
        "runner": r.name,
        "impl": r.impl,
        "precision": r.precision,
        "img_per_s": spec.batch_size / t.median,
        "img_per_s_best": spec.batch_size / min(t.times),
        "timing": t.to_dict(),
        "first_call_s": r.first_call_s,
        "achieved_flops": flops,
        "fraction_of_peak": flops / peak.flops,
        "memory": peak_memory(r.step, device),
        **r.info,
    }


def _vendor_peaks(device: torch.device, peaks: dict[str, Peak]) -> dict[str, Any]:
    """On a known GPU, the vendor's dense peak too (the usual MFU denominator)."""
    if device.type != "cuda":
        return {}
    from vitkit.bench.peak import gpu_spec_peak

    name = torch.cuda.get_device_name(device)
    found = {k: gpu_spec_peak(name, k) for k in peaks}
    return {k: v.to_dict() for k, v in found.items() if v is not None}


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    import platform

    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = hardware.cpu_model() or "unknown"
        info["threads"] = torch.get_num_threads()
    import importlib.metadata

    for package in ("transformers", "onnxruntime", "openvino", "nncf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package)
    return info


def gemm_shapes(model: VisionTransformer, batch_size: int, image_size: int) -> list[tuple[int, int, int]]:
    """The (M, K, N) of the model's four GEMMs per block (qkv, proj, fc1, fc2) at this batch and resolution."""
    cfg = model.cfg
    rows, d, h = batch_size * cfg.num_tokens(image_size), cfg.hidden_size, cfg.mlp_dim
    return [(rows, d, 3 * d), (rows, d, d), (rows, d, h), (rows, h, d)]
