"""One inference engine for every job: a model and its preprocessing, run at a precision on a backend.

:class:`InferenceEngine` is what every job puts its images through (the job runner builds it from the job's
:class:`~vitkit.inference.jobs.EngineSpec` and its plan; serve builds its own). It holds the checkpoint's fp32
model, its :class:`~vitkit.checkpoints.preprocess.Preprocess` and, for the fast precisions, the copy
``optimize_for_inference`` made of it, and gives batched logits, probabilities or pre-logits features (the
representation the paper's linear probes use), the tokens of a named block pooled (``features(x, layer=, pool=)``,
what ``vitkit embed`` stores) and the fp32 model's attention probabilities for analysis
(:meth:`InferenceEngine.attentions`). Callers use these and the engine's facts (``num_classes``, ``plan``,
``describe()``); what runs inside (``runner``: the model, the fast path or an ONNX engine) is the engine's own.

Precisions (:func:`vitkit.inference.policy.resolve_precision`; the path, dtype and device are the engine's plan,
:func:`vitkit.inference.policy.plan_engine`, made before the engine is built):

- ``fp32``: the checkpoint's own fp32 model, its own forward -- the reference, bit for bit what
  ``model(x)`` computes (and what earlier vitkit versions reported), with images decoded at full scale;
- ``bf16``: the bf16 fast path (pre-packed weights, fused kernels; ``vitkit.inference.fast``);
- ``int8``: dynamically quantised linear layers on the fast path (the rest in bf16 where the CPU computes
  bf16 natively, else fp32);
- ``fp8``: the transformer blocks' Linears as fp8 GEMMs, the rest bf16, on GPUs with fp8 tensor cores
  (``vitkit.inference.fp8``; refused elsewhere);
- ``auto``: the fastest path that computes the model's function up to floating-point rounding: the bf16
  fast path where bf16 matmuls are native *and* faster than fp32 ones (CUDA; a CPU with bf16 instructions
  where a measured GEMM says so, see :func:`vitkit.inference.policy.bf16_is_faster`), else the fp32 fast path
  where it pays (:func:`vitkit.inference.policy.fp32_fast_path_pays`: AVX-512 CPUs, GPUs), else the model itself.

Backends: ``torch`` (vitkit's fast path), ``onnxruntime`` (fp32, int8), ``openvino`` (fp32, bf16, NNCF int8,
calibrated on images), ``auto`` (the fastest of those installed, measured when built). The engines run
vitkit's ONNX export, which computes logits only: features on them are refused (ConfigError).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.eval_transform import Normalizer
from vitkit.data.gpu_decode import GpuDecoder
from vitkit.data.stream import StreamBatch
from vitkit.errors import ConfigError, DataError
from vitkit.images import load_image
from vitkit.inference.fast import optimize_for_inference
from vitkit.inference.fp8 import to_fp8
from vitkit.inference.policy import EnginePlan, fastest_sdpa_backend, plan_engine, sdpa_backend
from vitkit.inference.tune import Tuning, build_fast
from vitkit.models.vit import Intermediates, VisionTransformer

POOLS = ("cls", "gap", "cls+gap", "tokens")  # what :meth:`InferenceEngine.features` pools by, besides the model's own

CALIBRATION_MAX_IMAGES = 300  # NNCF's own default subset size: more images cost start-up time

Calibration = torch.Tensor | Callable[[], torch.Tensor]


def uses_calibration(backend: str, precision: str) -> bool:
    """Whether ``backend`` in ``precision`` calibrates on images: OpenVINO's int8 (NNCF post-training
    quantisation), with ``--backend openvino`` or ``auto``; vitkit's and ONNX Runtime's int8 quantise dynamically."""
    return backend in ("openvino", "auto") and precision == "int8"


def check_calibration_used(backend: str, precision: str) -> None:
    """Raise ConfigError naming ``--calibration`` when ``backend`` in ``precision`` would not use calibration
    images (see :func:`uses_calibration`)."""
    if not uses_calibration(backend, precision):
        raise ConfigError(
            "--calibration: only OpenVINO's int8 calibrates on images (--backend openvino or auto with "
            f"--precision int8), not --backend {backend} --precision {precision}"
        )


def calibration_batch(
    files: Sequence[str | os.PathLike[str]], pre: Preprocess, limit: int = CALIBRATION_MAX_IMAGES
) -> torch.Tensor:
    """Calibration images as the model sees them: decoded by the decoder of every command and transformed by
    the checkpoint's preprocessing, (N, C, H, W). Of more than ``limit`` files, ``limit`` spread evenly over the
    list are taken (a sorted class-per-folder tree then gives every class its share), and only those are
    decoded. Raises DataError naming ``--calibration`` and the file for one that does not decode."""
    if not files:
        raise DataError("--calibration: no image files given")
    picked = list(files) if len(files) <= limit else [files[i * len(files) // limit] for i in range(limit)]
    images = []
    for f in picked:
        try:
            images.append(pre.to_tensor(load_image(f), os.fspath(f)))
        except DataError as e:
            raise DataError(f"--calibration: {e}") from None
    return torch.stack(images)


def class_labels(loaded: Loaded) -> list[str] | None:
    """A checkpoint's class names, one per class of its head (None when it has none)."""
    if not loaded.meta.class_names:
        return None
    return [loaded.label(i) for i in range(loaded.model.cfg.num_classes)]


@dataclass(frozen=True)
class Outputs:
    """What one batch gave: pre-logits features (B, R) and/or logits (B, K), float32 on the CPU."""

    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class InferenceEngine:
    """A model, its preprocessing, a precision and a backend -> batched logits, probabilities or features.

    ``model``: the fp32 model (left untouched; the fast precisions run a copy). ``precision``/``backend``: see the
    module docstring (``auto`` resolved here); ``device`` a name (``auto``: this process's GPU where there is one,
    as :func:`vitkit.hardware.resolve_device`) or a device. ``plan``: what to run, made beforehand by
    :func:`~vitkit.inference.policy.plan_engine` (it replaces ``precision``, ``backend``, ``device`` and
    ``fp32_reference``; by default it is made here from them); :attr:`plan` is that plan with what building measured
    filled in (the backend ``auto`` chose, the kernel races' choice, the fastest SDPA backend). ``batch_size``: the
    batch the engine will mostly see, to choose oneDNN's weight layout and, on a GPU, the attention kernel (any
    batch works). ``calibration``: OpenVINO int8's calibration images (N, C, H, W), or a function giving them,
    called only when that engine is built (ConfigError when it is needed and missing). ``labels``: class names for
    :meth:`label`. ``fp32_reference=False`` runs an explicit ``fp32`` on the fp32 fast path instead of the model
    itself (a training run's validation pass). ``tune``: on the CPU, time the fast path's kernels on the model's
    shapes and keep the fastest, or the plain model where it wins (:mod:`vitkit.inference.tune`; cached per machine,
    model shape and batch); False keeps the built-in rules. Building takes time (packing weights, exporting and
    compiling for an engine): ``build_seconds`` says how much, :meth:`describe` says it all.

    The seam for measuring a job without its model: build the engine, set ``runner`` (what it runs in the model's
    place, called on the batch as the model would be) and, on the GPU path, ``normalizer``, and give the job
    ``EngineSpec.of_engine(engine)``; a plan whose class answers ``feeds_gpu`` True takes the GPU path's transform
    without a GPU. ``benchmarks/pipeline.py`` does both and refuses a figure in which its replacement did not run.
    """

    def __init__(
        self,
        model: VisionTransformer,
        preprocess: Preprocess,
        *,
        precision: str = "auto",
        backend: str = "torch",
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        calibration: Calibration | None = None,
        labels: Sequence[str] | None = None,
        fp32_reference: bool = True,
        tune: bool = True,
        plan: EnginePlan | None = None,
    ) -> None:
        if plan is None:
            plan = plan_engine(precision, backend, device, fp32_reference=fp32_reference, batch_size=batch_size)
        self.device = plan.device
        self.model = model.eval().to(self.device)
        self.preprocess = preprocess
        self.normalizer = Normalizer(preprocess)
        self.labels = list(labels) if labels else None
        self.precision = plan.precision
        self.backend = plan.backend
        self.tune = tune
        self.tuning: Tuning | None = None  # the CPU fast path's measured choice (vitkit.inference.tune)
        self.attention: str | None = None  # CUDA: the SDPA backend measured fastest (None: PyTorch's own choice)
        self.plan = plan
        start = time.perf_counter()
        self.runner: torch.nn.Module = self.model  # the reference and plain paths: the model itself
        if plan.path == "fast":
            self.runner = self._build(batch_size, calibration)
            self.backend = getattr(self.runner, "backend", self.backend)  # auto: the one it chose
            self.attention = self._fastest_attention(batch_size)
            t = self.tuning
            self.plan = dataclasses.replace(  # the plan with what building measured: what describe() prints
                plan, backend=self.backend, attention=self.attention, plain_model=bool(t and t.plain),
                kernels=t.summary() if t is not None and (t.plain or t.races) else None,
            )  # fmt: skip
        self.build_seconds = time.perf_counter() - start

    @classmethod
    def from_loaded(cls, loaded: Loaded, **kwargs: Any) -> InferenceEngine:
        """An engine for a loaded checkpoint: its model, preprocessing and class names."""
        return cls(loaded.model, loaded.meta.preprocess, labels=class_labels(loaded), **kwargs)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike[str], *, format: str | None = None, **kwargs: Any
    ) -> InferenceEngine:
        """:meth:`from_loaded` of ``load_checkpoint(path, format=format)``."""
        return cls.from_loaded(load_checkpoint(path, format=format), **kwargs)

    def _build(self, batch_size: int, calibration: Calibration | None) -> torch.nn.Module:
        if self.precision == "fp8":
            return to_fp8(self.model)
        dtype, int8 = self.plan.dtype, self.precision == "int8"
        images = None
        if uses_calibration(self.backend, self.precision):
            if calibration is None and self.backend == "openvino":
                raise ConfigError("--backend openvino --precision int8: NNCF needs calibration images")
            images = calibration() if callable(calibration) else calibration
        try:
            if self.backend == "torch" and self.device.type == "cpu":  # kernels (or the plain model) by measurement
                runner, self.tuning = build_fast(self.model, dtype, batch_size, int8, tune=self.tune)
                return runner
            return optimize_for_inference(
                self.model, dtype, int8=int8, batch_size=batch_size, backend=self.backend, calibration=images,
                compile=self.plan.compile, compile_mode=self.plan.compile_mode,
            )  # fmt: skip
        except ValueError as e:  # e.g. int8 without oneDNN, bf16 on ONNX Runtime
            option = "--precision" if self.backend == "torch" else f"--backend {self.backend} --precision"
            raise ConfigError(f"{option} {self.precision}: {e}") from None

    def _fastest_attention(self, batch_size: int) -> str | None:
        """The plan's SDPA candidates (CUDA) timed on the model's attention shape: the fastest, or None."""
        if not self.plan.sdpa_candidates:
            return None
        cfg = self.model.cfg
        shape = (batch_size, cfg.num_heads, cfg.num_tokens(), cfg.hidden_size // cfg.num_heads)
        return fastest_sdpa_backend(self.plan.sdpa_candidates, shape, self.plan.dtype, self.device)[0]

    # ---- facts ----------------------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.model.cfg.num_classes

    @property
    def gives_features(self) -> bool:
        """Whether :meth:`features` works: the torch paths do; the ONNX engines give logits only."""
        return self.backend == "torch"

    def label(self, index: int) -> str:
        """The name of class ``index`` (``"class N"`` without class names)."""
        return self.labels[index] if self.labels and index < len(self.labels) else f"class {index}"

    def label_names(self) -> np.ndarray:
        """:meth:`label` of every class, as an object array indexed by class (so that a batch's top-k classes
        (G, k) index it at once); made on first use."""
        names = getattr(self, "_label_names", None)
        if names is None:
            names = np.empty(self.num_classes, dtype=object)
            names[:] = [self.label(c) for c in range(self.num_classes)]
            self._label_names = names
        return names

    def describe(self) -> str:
        """One line: the plan as built (:meth:`~vitkit.inference.policy.EnginePlan.describe`: what the CPU's
        kernel races or the GPU's attention race chose) and the build's cost, e.g. ``bf16 fast path on cpu,
        built in 0.6 s``."""
        built = f", built in {self.build_seconds:.1f} s" if self.plan.path == "fast" else ""
        return self.plan.describe() + built

    # ---- compute --------------------------------------------------------------------------------------

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Images as a job hands them over -> the model's input on the engine's device. uint8 pixels (B, C, H,
        W) (:class:`~vitkit.data.eval_transform.EvalTransform` with ``uint8=True``) are copied to the device
        (``non_blocking`` on CUDA) and normalised there: bit for bit the float values the CPU would have computed
        (:class:`~vitkit.data.eval_transform.Normalizer`). Float images, already normalised, are copied as
        they are."""
        if x.device != self.device:
            x = x.to(self.device, non_blocking=self.device.type == "cuda")
        return self.normalizer(x) if x.dtype == torch.uint8 and x.numel() else x

    def feed(self, batches: Iterable[StreamBatch], decoder: GpuDecoder | None = None) -> Iterator[StreamBatch]:
        """``batches`` with their images already :meth:`prepare` d. On CUDA the copy and normalisation of each
        batch are issued on a side stream as soon as it arrives, and the batch is handed over only once the
        next one has arrived and been issued: the copy of batch n+1 overlaps the forward pass of batch n (one
        more batch is held, on the device). Elsewhere the batches pass through as they are (``forward``
        prepares them). ``decoder`` (``--decode gpu``): a batch's undecoded JPEGs (``StreamBatch.encoded``)
        are decoded, resized and put among its other images there, on the same stream, before normalising."""
        if self.device.type != "cuda":
            for b in batches:
                if decoder is not None and b.encoded is not None:
                    b = dataclasses.replace(b, images=decoder.images(b)[0], encoded=None)
                yield b
            return
        side = torch.cuda.Stream(device=self.device)
        ahead: tuple[StreamBatch, Any, list[Any]] | None = None
        for b in batches:
            keep: list[Any] = []
            with torch.cuda.stream(side):
                images = b.images
                if decoder is not None and b.encoded is not None:
                    images, keep = decoder.images(b)
                staged = dataclasses.replace(b, images=self.prepare(images), encoded=None)
                ready = torch.cuda.Event()
                ready.record(side)
            if ahead is not None:
                yield self._on_main_stream(*ahead)
            ahead = (staged, ready, keep)
        if ahead is not None:
            yield self._on_main_stream(*ahead)

    def _on_main_stream(self, b: StreamBatch, ready: Any, keep: list[Any]) -> StreamBatch:
        main = torch.cuda.current_stream(self.device)
        main.wait_event(ready)  # the forward pass waits for the copy on the GPU, not the CPU
        if keep:  # the decoder's outputs, read by work on the side stream: freed only once that is done
            ready.synchronize()
        if b.images.device.type == "cuda":
            b.images.record_stream(main)  # made on the side stream, used (and freed) on this one
        return b

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, *, logits: bool = True, features: bool = False) -> Outputs:
        """Images (B, C, H, W), preprocessed -> :class:`Outputs` with the pre-logits features (B, R) and/or the
        logits (B, K), float32 on the CPU. The reference path computes exactly ``model.forward_head(
        model.forward_features(x), pre_logits=True)`` and ``model.head`` of it (= ``model(x)``; DeiT's distilled
        logits, the mean of two heads on two tokens, are ``forward_head`` of the same tokens)."""
        if not (logits or features):
            raise ValueError("nothing to compute: ask for logits, features or both")
        if logits and self.num_classes <= 0:
            raise ConfigError("the model has no classification head (num_classes=0); logits are not defined")
        x = self.prepare(x)
        if features and not self.gives_features:
            raise ConfigError(
                f"--backend {self.backend} computes logits only (vitkit's ONNX export); features need --backend torch"
            )
        runner: Any = self.runner
        with sdpa_backend(self.attention):
            if not features:
                return Outputs(logits=runner(x).float().cpu())
            tokens = runner.forward_features(x)  # (B, T, D)
            rep = runner.forward_head(tokens, pre_logits=True)  # (B, R)
            out = None
            if logits:
                out = (runner.forward_head(tokens) if self.model.cfg.distilled else runner.head(rep)).float().cpu()
        return Outputs(features=rep.float().cpu(), logits=out)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, K), float32."""
        out = self.forward(x).logits
        assert out is not None
        return out

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> class probabilities (B, K), float32 (softmax of the logits in float32)."""
        return self.logits(x).softmax(dim=-1)

    @torch.inference_mode()
    def features(self, x: torch.Tensor, *, layer: int | None = None, pool: str | None = None) -> torch.Tensor:
        """(B, C, H, W) -> features, float32 on the CPU (ConfigError on the ONNX engines). By default the
        pre-logits features (B, R). With ``layer`` (a block, 1..L, negative from the end) and/or ``pool``, the
        tokens of :meth:`tokens` pooled: ``"cls"`` the class token, ``"gap"`` the mean of the patch tokens
        (prefix tokens left out), ``"cls+gap"`` the two concatenated (B, 2D: DINOv2's linear-probe features),
        ``"tokens"`` every token (B, T, D), None the model's own pooling (D,)."""
        if pool is not None and pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)} or None, got {pool!r}")
        if pool is None and layer is None:
            out = self.forward(x, logits=False, features=True).features
            assert out is not None
            return out
        tokens = self.tokens(x, layer)
        if pool == "tokens":
            pooled = tokens
        elif pool == "cls":
            pooled = tokens[:, 0]
        elif pool in ("gap", "cls+gap"):
            gap = tokens[:, self.model.cfg.num_prefix_tokens :].mean(dim=1)
            pooled = gap if pool == "gap" else torch.cat([tokens[:, 0], gap], dim=-1)  # (B, D) or (B, 2D)
        else:  # the model's own pooling of an intermediate block
            pooled = self.model.pool(tokens.float())
        return pooled.float().cpu()

    @torch.inference_mode()
    def tokens(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """(B, C, H, W) -> tokens (B, T, D) on the engine's device, in its path's dtype: the final normed tokens,
        or with ``layer`` the output of that block (1..L, negative from the end) before the final norm. The fast
        path runs only the first ``layer`` blocks; the reference path (and a runner without that entry: the plain
        model a kernel race chose, fp8) takes them from the fp32 model's ``forward_intermediates``."""
        if not self.gives_features:
            raise ConfigError(
                f"--backend {self.backend} computes logits only (vitkit's ONNX export); tokens need --backend torch"
            )
        x = self.prepare(x)  # on the device, normalised (a GPU job's batches are uint8)
        runner: Any = self.runner
        if layer is None:
            return runner.forward_features(x)  # (B, T, D), final norm
        depth = layer if layer > 0 else self.model.cfg.depth + 1 + layer
        if not 1 <= depth <= self.model.cfg.depth:
            raise ValueError(f"layer must be in 1..{self.model.cfg.depth} or negative from the end, got {layer}")
        if hasattr(runner, "forward_blocks"):  # the fast path: only the first ``depth`` blocks
            return runner.forward_blocks(x, depth)
        return self.model.forward_intermediates(x, attention=False).hidden_states[depth]

    @torch.inference_mode()
    def attentions(self, x: torch.Tensor) -> Intermediates:
        """(B, C, H, W) -> the fp32 model's ``forward_intermediates`` (every block's attention probabilities,
        hidden states and logits), on the engine's device: for attention maps, which the fast path never
        materialises (run only for the images that ask for them)."""
        return self.model.forward_intermediates(x.to(self.device))

    def warm_up(self, batch_sizes: Iterable[int]) -> None:
        """One forward at each batch size, so the first real calls meet ready kernels."""
        C, (H, W) = self.model.cfg.in_channels, self.preprocess.image_size
        for b in sorted(set(batch_sizes)):
            self.forward(torch.zeros(b, C, H, W), logits=self.num_classes > 0, features=self.num_classes <= 0)
