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
import math
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
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.inference import optimize_for_inference
from vitkit.inference.backends import EngineModel
from vitkit.inference.policy import fast_dtype
from vitkit.inference.tune import build_fast
from vitkit.models.cost import cost_table
from vitkit.models.vit import VisionTransformer
from vitkit.timing import Timing, synchronize, time_alternating
from vitkit.train import kernels
from vitkit.train.distributed import checkpoint_activations
from vitkit.train.heap import heap_kept
from vitkit.train.optim import adam_kernel

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


def _input_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


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
    xin = x.to(_input_dtype(precision)) if impl != "vitkit-fast" else x
    x1 = xin[:1].clone()

    def output(images: torch.Tensor) -> torch.Tensor:
        images = images.to(_input_dtype(precision)) if impl != "vitkit-fast" else images
        with torch.no_grad(), _autocast(precision, device):
            return fn(images).float()

    def step() -> None:
        with torch.no_grad(), _autocast(precision, device):
            fn(xin)

    def latency() -> None:
        with torch.no_grad(), _autocast(precision, device):
            fn(x1)

    name = f"{impl}{'+compile' if spec.compile and impl != 'vitkit-fast' else ''} [{precision}]"
    return Runner(name, impl, precision, step, output, latency)


def _engine_runner(fn: EngineModel, x: torch.Tensor) -> Runner:
    """An ONNX Runtime / OpenVINO model (``vitkit.bench.engines``) as a runner: float images in, logits out."""
    x1 = x[:1].clone()
    name = f"{fn.backend} [{fn.precision}]"
    return Runner(name, fn.backend, fn.precision, lambda: fn(x), fn, lambda: fn(x1), info={"engine": fn.detail})


def train_runners(spec: BenchSpec, model: VisionTransformer, x: torch.Tensor) -> list[Runner]:
    """One training step (forward, cross-entropy, backward, fused AdamW) per (implementation, precision).

    Each implementation also runs with its explicit-softmax attention (vitkit ``set_fused_attention(False)``,
    transformers ``attn_implementation="eager"``): on CPU its backward beats the fused kernel's at ViT's
    sequence lengths. With ``grad_checkpointing`` every variant also runs with activation checkpointing.
    """
    device = x.device
    labels = torch.randint(0, model.cfg.num_classes, (x.shape[0],), device=device)
    # (impl, module, is_transformers, tag): the fused-attention variant first
    variants: list[tuple[str, nn.Module, bool, str]] = []
    for fused in (True, False):
        m = copy.deepcopy(model)
        m.set_fused_attention(fused)
        if device.type == "cpu" and not spec.compile:  # the C training kernels, as the trainer (None: PyTorch's)
            m.set_training_kernels(kernels.load())
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
    """Run one benchmark and return the results as a JSON-ready dict (see ``format_report``).

    Training steps run with freed memory kept in the heap, as ``vitkit train`` runs them (``heap_kept``),
    for every runner alike: the ratios compare the steps' kernels, not the allocator."""
    spec.validate()
    with heap_kept() if spec.task == "train" else contextlib.nullcontext():
        return _run_bench(spec, progress)


def _run_bench(spec: BenchSpec, progress: Callable[[str], None] | None) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    device = hardware.resolve_device(spec.device)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    model, pre = build_model(spec)
    if spec.compare and "transformers" in spec.compare:
        from vitkit.bench.peers import transformers_config

        transformers_config(model)  # fail early, naming what transformers cannot represent
    check_engines(spec.compare, spec.precisions, spec.task, spec.device)
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(spec.batch_size, model.cfg.in_channels, spec.image_size, spec.image_size, generator=gen)
    x = x.to(device)
    fpi = flops_per_image(model, spec.image_size)
    say("measuring peak")
    peaks: dict[str, Peak] = {}
    shapes = gemm_shapes(model, spec.batch_size, spec.image_size)
    for p in spec.precisions:
        kind = _PEAK_KIND[p]
        if kind not in peaks:
            peaks[kind] = measure_peak(kind, device, gemm_shapes=shapes)
    say("building runners")
    runners = inference_runners(spec, model, x) if spec.task == "inference" else train_runners(spec, model, x)
    runners += [_engine_runner(m, x) for m in engine_models(spec.compare, spec.precisions, model, pre)]
    settle = SETTLE_S if engines_in(spec.compare) else 0.0
    for r in runners:  # warm-up; the first call includes compilation / lazy packing
        say(f"warm-up {r.name}")
        for i in range(max(spec.warmup, 1 if spec.compile else 0)):
            synchronize(device)
            t0 = time.perf_counter()
            r.step()
            synchronize(device)
            if i == 0:
                r.first_call_s = time.perf_counter() - t0
    say(f"timing {len(runners)} runners x {spec.repeats} repeats")
    timings = time_alternating({r.name: r.step for r in runners}, spec.repeats, device, threads, settle)
    latencies: dict[str, Timing] = {}
    if spec.task == "inference" and spec.latency:
        say("latency at batch 1")
        lat_fns: dict[str, Callable[[], Any]] = {r.name: r.latency_step for r in runners if r.latency_step is not None}
        for fn in lat_fns.values():
            fn()
        latencies = time_alternating(lat_fns, max(spec.repeats, 5), device, threads, settle)
    say("measuring peak again")
    for kind, before in peaks.items():  # a busy machine only lowers a reading: keep the higher one
        after = measure_peak(kind, device, gemm_shapes=shapes)
        peaks[kind] = after if after.flops > before.flops else before
    reference = None
    real: tuple[torch.Tensor, torch.Tensor] | None = None
    if spec.task == "inference":
        with torch.inference_mode():
            reference = model(x).float()
            if spec.real_images:
                from vitkit.bench.images import real_image_batch

                images = real_image_batch(pre).to(device)
                real = (images, _batched(lambda t: model(t).float(), images, spec.batch_size))
    flop_factor = 1.0 if spec.task == "inference" else 3.0  # a training step: forward + 2x for backward
    rows = []
    for r in runners:
        say(f"memory {r.name}")
        t = timings[r.name]
        kind = _PEAK_KIND[r.precision]
        flops = flop_factor * fpi * spec.batch_size / t.median
        row: dict[str, Any] = {
            "runner": r.name,
            "impl": r.impl,
            "precision": r.precision,
            "img_per_s": spec.batch_size / t.median,
            "img_per_s_best": spec.batch_size / min(t.times),
            "timing": t.to_dict(),
            "first_call_s": r.first_call_s,
            "achieved_flops": flops,
            "fraction_of_peak": flops / peaks[kind].flops,
            "memory": peak_memory(r.step, device),
            **r.info,
        }
        if r.name in latencies:
            row["latency_b1_ms"] = 1e3 * latencies[r.name].median
        if reference is not None and r.output is not None:
            row["agreement_vs_fp32"] = _agreement(r.output(x), reference)
        if real is not None and r.output is not None:
            say(f"real images {r.name}")
            row["agreement_real_images"] = _agreement(_batched(r.output, real[0], spec.batch_size), real[1])
            row["agreement_real_images"]["images"] = real[0].shape[0]
        rows.append(row)
    _add_ratios(rows)
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


def _vendor_peaks(device: torch.device, peaks: dict[str, Peak]) -> dict[str, Any]:
    """On a known GPU, the vendor's dense peak too (the usual MFU denominator)."""
    if device.type != "cuda":
        return {}
    from vitkit.bench.peak import gpu_spec_peak

    name = torch.cuda.get_device_name(device)
    found = {k: gpu_spec_peak(name, k) for k in peaks}
    return {k: v.to_dict() for k, v in found.items() if v is not None}


# A peer whose logits are this far from fp32's (relative error), and farther than PEER_ERR_FACTOR x vitkit's own
# at that precision, computes a different function (OpenVINO's NNCF int8 on a random-weight model: rel err 0.38,
# top-1 agreement 0.375): it is reported, but not a peer to be faster than
PEER_MAX_REL_ERR = 0.1
PEER_ERR_FACTOR = 5.0


def _invalid_peers(rows: list[dict[str, Any]]) -> None:
    """Mark (``left_out``, with the reason) the peer rows whose outputs fail the bound above."""
    for p in rows:
        agree = p.get("agreement_vs_fp32")
        if p["impl"] in ("vitkit", "vitkit-fast") or not agree:
            continue
        ours = [
            r["agreement_vs_fp32"]["rel_err"]
            for r in rows
            if r["impl"] in ("vitkit", "vitkit-fast")
            and r["precision"] == p["precision"]
            and r.get("agreement_vs_fp32")
        ]
        bound = max([PEER_MAX_REL_ERR, *(PEER_ERR_FACTOR * e for e in ours)])
        if agree["rel_err"] > bound:
            p["left_out"] = (
                f"relative error {agree['rel_err']:.2g} against fp32 (> {bound:.2g}), top-1 agreement "
                f"{agree['top1_agreement']:.3f}: it computes a different function, not a peer to compare speed with"
            )


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each vitkit row: speed over the peer at the same precision, and over the peer's fastest run of the same
    kind (floating point or int8; with or without activation checkpointing). Peers whose outputs are not the
    model's function (:func:`_invalid_peers`) are left out, with the reason in their row."""
    _invalid_peers(rows)
    peers = [r for r in rows if r["impl"] not in ("vitkit", "vitkit-fast") and "left_out" not in r]
    if not peers:
        return
    for r in rows:
        if r["impl"] not in ("vitkit", "vitkit-fast"):
            continue
        same = [p for p in peers if p["precision"] == r["precision"] and "+ckpt" not in p["runner"]]
        if "+ckpt" in r["runner"]:
            same = [p for p in peers if p["precision"] == r["precision"] and "+ckpt" in p["runner"]] or same
        comparable = [
            p
            for p in peers
            if ("+ckpt" in p["runner"]) == ("+ckpt" in r["runner"])
            and (p["precision"] == "int8") == (r["precision"] == "int8")  # floating point vs int8
        ]
        best = max(comparable or peers, key=lambda p: p["img_per_s"])
        r["speedup_vs_peer_same_precision"] = r["img_per_s"] / same[0]["img_per_s"] if same else None
        r["speedup_vs_peers"] = {p["runner"]: r["img_per_s"] / p["img_per_s"] for p in same}
        r["speedup_vs_peer_best"] = r["img_per_s"] / best["img_per_s"]
        r["peer_best"] = best["runner"]


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


# ---- text report -------------------------------------------------------------------------------------


def gemm_shapes(model: VisionTransformer, batch_size: int, image_size: int) -> list[tuple[int, int, int]]:
    """The (M, K, N) of the model's four GEMMs per block (qkv, proj, fc1, fc2) at this batch and resolution."""
    cfg = model.cfg
    rows, d, h = batch_size * cfg.num_tokens(image_size), cfg.hidden_size, cfg.mlp_dim
    return [(rows, d, 3 * d), (rows, d, d), (rows, d, h), (rows, h, d)]


def format_report(result: dict[str, Any]) -> str:
    """A human-readable table of ``run_bench``'s result."""
    spec = result["spec"]
    lines = [
        f"{result['model_name']} {spec['task']} @ {spec['image_size']}px ({result['tokens']} tokens), batch "
        f"{spec['batch_size']}, {result['machine'].get('cpu') or result['machine'].get('gpu')} "
        f"({result['machine'].get('threads', 1)} threads), {result['gflops_per_image']:.2f} GFLOP/image forward",
    ]
    for kind, p in result["peaks"].items():
        lines.append(
            f"  peak {kind}: {p['flops'] / 1e9:.0f} G{'OP' if kind == 'int8' else 'FLOP'}/s ({p['method']}, "
            f"{p['threads']} threads{'; ' + p['detail'] if p['method'] in ('fma-loop', 'amx-matmul') else ''})"
        )
    for kind, p in result.get("vendor_peaks", {}).items():
        lines.append(
            f"  vendor dense peak {kind}: {p['flops'] / 1e12:.0f} TFLOP/s ({p['detail']}); rows carry "
            "fraction_of_vendor_peak in the JSON"
        )
    real = any("agreement_real_images" in r for r in result["results"])
    head = f"  {'runner':<44}{'img/s':>8}{'best':>8}{'IQR':>15}{'GFLOP/s':>9}{'%peak':>7}{'cpu':>5}{'mem MiB':>9}"
    if spec["task"] == "inference":
        head += f"{'b1 ms':>8}{'rel err':>9}{'top1':>7}" + (f"{'real t1':>8}" if real else "")
    head += f"{'x same':>8}{'x best':>8}"
    lines.append(head)
    for r in result["results"]:
        t = r["timing"]
        ips_iqr = f"{spec['batch_size'] / t['q3_s']:.2f}-{spec['batch_size'] / t['q1_s']:.2f}"
        mem = r["memory"]["delta_mib"]
        line = (
            f"  {r['runner']:<44}{r['img_per_s']:>8.2f}{r['img_per_s_best']:>8.2f}{ips_iqr:>15}"
            f"{r['achieved_flops'] / 1e9:>9.0f}"
            f"{100 * r['fraction_of_peak']:>6.0f}%{t['cpu_util']:>5.2f}{_fmt(mem, '.0f'):>9}"
        )
        if spec["task"] == "inference":
            agree = r.get("agreement_vs_fp32", {})
            line += (
                f"{_fmt(r.get('latency_b1_ms'), '.1f'):>8}{_fmt(agree.get('rel_err'), '.1e'):>9}"
                f"{_fmt(agree.get('top1_agreement'), '.3f'):>7}"
            )
            if real:
                line += f"{_fmt(r.get('agreement_real_images', {}).get('top1_agreement'), '.3f'):>8}"
        line += (
            f"{_fmt(r.get('speedup_vs_peer_same_precision'), '.2f'):>8}{_fmt(r.get('speedup_vs_peer_best'), '.2f'):>8}"
        )
        lines.append(line)
    if any("speedup_vs_peer_best" in r for r in result["results"]):
        lines.append(
            "  x same: speed over the peer at the same precision; x best: over the peer's fastest run here "
            "(float vs float, int8 vs int8)"
        )
    for r in result["results"]:
        if "left_out" in r:
            lines.append(f"  {r['runner']}: left out of x same / x best: {r['left_out']}")
    for r in result["results"]:
        if r["impl"] == "vitkit-fast" and "kernels" in r:
            lines.append(f"  {r['runner']}: {r['kernels']['describe']}")
    for r in result["results"]:
        if r["impl"] == "vitkit-fast" and r.get("speedup_vs_peers") and r["peer_best"] != r["runner"]:
            each = ", ".join(f"{v:.2f}x {k}" for k, v in r["speedup_vs_peers"].items())
            lines.append(f"  {r['runner']}: {each}")
    lines.append(
        "  %peak: achieved FLOP/s over the peak above (training counts 3x the forward FLOPs); cpu: CPU "
        "share the process got (<0.9: the machine was busy); mem: peak memory increase of one call; rel err, "
        "top1: against fp32 vitkit on the timed batch (real t1: on real images)"
    )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)
