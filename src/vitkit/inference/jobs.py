"""The one runner of every batch job (``predict``, ``embed``, the features of ``eval``/``fewshot``/``knn`` and of
``finetune --method linear``, and ``vitkit.predict``/``vitkit.embed`` in Python): a source's images streamed
through an :class:`~vitkit.inference.engine.InferenceEngine`, a *task* turning each batch into columns, and a
sink taking them, batch by batch, with a progress bar, resuming where an earlier output stops.

A :class:`Job` is the source, the engine (an :class:`EngineSpec`, planned before anything is built: its
precision and backend say whether JPEGs are decoded in full, so the transform and ``--decode`` follow and the
decoding workers start while the weights are packed; or the spec of an engine already built), the batch and the
decoding. A task is a function ``(engine, batch) -> columns``; a sink is anything with ``write(columns)``,
``done`` and ``ids``: an output file (:mod:`vitkit.outputs`), the console, or memory (:class:`Collect`).

Under ``torchrun`` (``dist``: :func:`vitkit.distributed.setup`) the positions still to do are dealt out over the
processes in batches (:func:`vitkit.distributed.shard_steps`: batch ``c`` to process ``c % world``, the one
sharding scheme) and process 0, the only one with a sink, gathers every step's rows and writes them in input
order: the output is the one a single process writes, and it resumes the same way (with any number of
processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from vitkit.checkpoints import Loaded
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.eval_transform import EvalTransform
from vitkit.data.gpu_decode import (
    DECODES,
    GpuDecoder,
    GpuDecodeTransform,
    choose_decode,
    measure_rates,
    nvimgcodec_module,
)
from vitkit.data.stream import (
    FileSource,
    ImageSource,
    StreamBatch,
    Transform,
    default_workers,
    stream_batches,
    stream_iterable,
)
from vitkit.distributed import DistInfo, broadcast_from_main, check_same_input, gather_to_main, shard_steps
from vitkit.errors import ConfigError, DataError, VitkitError
from vitkit.hardware import CpuShare, total_memory
from vitkit.inference.engine import CALIBRATION_MAX_IMAGES, InferenceEngine, class_labels
from vitkit.inference.policy import EnginePlan, plan_engine
from vitkit.models.vit import VisionTransformer
from vitkit.textids import text_id


class Sink(Protocol):
    """Where a job's rows go: ``write`` one batch of columns; ``done`` rows (with ``ids``) there already."""

    @property
    def done(self) -> int: ...

    ids: list[str]

    def write(self, columns: Mapping[str, Any]) -> None: ...


@dataclass
class JobSummary:
    """What a job did: ``total`` positions, of which ``resumed`` were in the output already and ``written``
    were written now; ``failed`` of those marked failed (``skip_bad``), the first with its reason; the engine's
    description (None when nothing was left to compute) and the seconds of the loop."""

    total: int
    resumed: int = 0
    written: int = 0
    failed: int = 0
    first_failure: str | None = None
    engine: str | None = None
    seconds: float = 0.0
    decode_note: str | None = None  # with --decode gpu: what decoded the images (DecodeCounts.note)
    built: InferenceEngine | None = field(default=None, repr=False)  # the engine that ran (None: nothing left)

    def failure_note(self) -> str | None:
        """The one-line account of the images that failed (None when none did)."""
        if not self.failed:
            return None
        return f"{self.failed} of {self.written} image(s) failed and are marked as such (first: {self.first_failure})"

    def wrote_note(self, what: str, out: str | os.PathLike[str]) -> str:
        """The closing line of a job that wrote ``out``: the ``what`` (rows, embeddings) it holds, resumed ones
        counted."""
        again = f" ({self.resumed} were there already)" if self.resumed else ""
        return f"wrote {self.resumed + self.written} {what} to {out}{again}"


def plan_decode(
    decode: str,
    transform: Transform,
    plan: EnginePlan,
    source: ImageSource,
    positions: Sequence[int],
    workers: int,
) -> tuple[Transform, Callable[[], GpuDecoder] | None]:
    """``--decode`` for a job: the transform its workers run and, when its JPEGs are decoded on the GPU, a
    function giving the :class:`~vitkit.data.gpu_decode.GpuDecoder` on the engine ``plan``'s device (made once,
    when first called: after the engine, so that the workers start before CUDA does). ``gpu`` needs a CUDA job,
    nvImageCodec and the fast path (``--precision fp32`` is Pillow's decode bit for bit): else one-line
    ConfigError. ``auto``: the GPU where :func:`~vitkit.data.gpu_decode.choose_decode` measures it faster on
    the job's first JPEGs."""
    if decode not in DECODES:
        raise ConfigError(f"--decode {decode!r}: choose one of {', '.join(DECODES)}")
    if decode == "cpu":
        return transform, None
    if not isinstance(transform, EvalTransform) or transform.reference:
        if decode == "gpu":
            raise ConfigError(
                "--decode gpu: --precision fp32 is the reference, decoded by Pillow bit for bit; choose another "
                "--precision, or --decode cpu"
            )
        return transform, None
    cpu = dataclasses.replace(transform, uint8=True)
    made: list[GpuDecoder] = []

    def decoder() -> GpuDecoder:
        if not made:
            made.append(GpuDecoder(cpu.preprocess, nvimgcodec_module(), plan.device))
        return made[0]

    rates = lambda: measure_rates(source, positions, cpu, decoder(), workers)  # noqa: E731
    if not choose_decode(decode, plan.feeds_gpu, rates=rates):
        return transform, None
    return GpuDecodeTransform(cpu), decoder


def check_resume(ids: Sequence[str], source: ImageSource, positions: Sequence[int], where: str) -> None:
    """The rows already in an output (their ``ids``) must be those of the job's first positions, in order:
    else DataError naming the first that differs (the input changed; ``where`` names the output)."""
    if len(ids) > len(positions):
        raise DataError(f"{where}: holds {len(ids)} rows but the input has {len(positions)} images; not this input")
    for i, (got, pos) in enumerate(zip(ids, positions, strict=False)):
        want = text_id(source.item_id(pos))  # ids are written in that form (non-UTF-8 bytes as \xNN)
        if got != want:
            raise DataError(
                f"{where}: row {i + 1} is {got!r} but the input's image {i + 1} is {want!r}; the input changed since "
                "the output was started (write to a new --out, or pass --overwrite to start again)"
            )


@dataclass(frozen=True)
class EngineSpec:
    """The engine a job will run, known before it is built: a model and its preprocessing, and the engine's
    ``plan`` (:func:`~vitkit.inference.policy.plan_engine`, made once from the request and the machine: its
    precision, backend and device; ``labels``: class names). The job's transform (full or reduced decode, uint8 or
    float), its decoding workers and the engine all read the plan, so the job starts decoding before the weights
    are packed. ``built``: the engine already built (:meth:`of_engine`; one engine for several jobs, its weights
    packed once), which :meth:`build` gives."""

    model: VisionTransformer
    preprocess: Preprocess
    plan: EnginePlan
    labels: Sequence[str] | None = None
    built: InferenceEngine | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, loaded: Loaded, *, precision: str = "fp32", backend: str = "torch", device: torch.device | str = "cpu"
    ) -> EngineSpec:
        """The spec of a loaded checkpoint (its model, preprocessing and class names) in ``precision`` on ``backend``
        and ``device``: planned now (ConfigError for a request that cannot run)."""
        return cls(loaded.model, loaded.meta.preprocess, plan_engine(precision, backend, device), class_labels(loaded))

    @classmethod
    def of_engine(cls, engine: InferenceEngine) -> EngineSpec:
        """The spec of an engine already built: its own plan (as built)."""
        return cls(engine.model, engine.preprocess, engine.plan, engine.labels, built=engine)

    def transform(self) -> EvalTransform:
        """What a job's decoding workers run for this engine: JPEGs decoded in full for the reference, at reduced
        scale otherwise; uint8 pixels for an engine on a GPU (normalised there), normalised floats otherwise."""
        return EvalTransform(self.preprocess, reference=self.plan.full_decode, uint8=self.plan.feeds_gpu)

    def workers(self, workers: int | None) -> int:
        """``workers`` as given, or (None) the default for where the engine runs
        (:func:`vitkit.data.stream.default_workers`: every core but one for a GPU's engine)."""
        return default_workers(gpu=self.plan.feeds_gpu) if workers is None else workers

    def on(self, info: DistInfo) -> EngineSpec:
        """The spec for one process of a ``torchrun`` job: planned for that process's device (an engine already
        built stays where it is)."""
        if self.built is not None or not info.enabled:
            return self
        return dataclasses.replace(self, plan=self.plan.on(info.device))

    def build(self, batch_size: int, calibration: Callable[[], torch.Tensor] | None) -> InferenceEngine:
        """The engine of the plan (weights packed, kernels chosen by measurement and recorded on its plan) for
        batches of about ``batch_size`` (the one already built, if any)."""
        if self.built is not None:
            return self.built
        return InferenceEngine(
            self.model, self.preprocess, plan=self.plan, batch_size=batch_size, calibration=calibration,
            labels=self.labels,
        )  # fmt: skip


def engine_spec(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    preprocess: Preprocess,
    *,
    precision: str = "fp32",
    backend: str = "torch",
    device: torch.device | str | None = "cpu",
) -> EngineSpec:
    """What the evaluators and :func:`~vitkit.inference.features.extract` are given, as the one thing a job runs:
    a spec as it is; an engine already built as its spec (:meth:`EngineSpec.of_engine`: its own plan; the other
    arguments are not used); a model as the spec of ``preprocess``, ``precision``, ``backend`` and ``device``
    (None: ``auto``), planned now."""
    if isinstance(model, EngineSpec):
        return model
    if isinstance(model, InferenceEngine):
        return EngineSpec.of_engine(model)
    return EngineSpec(model, preprocess, plan_engine(precision, backend, "auto" if device is None else device))


Items = Iterable[tuple[Any, str, int]]  # (file path or PIL image, id, label): a source read once, in order


def image_source(images: Iterable[Any]) -> ImageSource | Items:
    """The source of the Python API's images (file paths or PIL images): a list or tuple of paths is a
    :class:`~vitkit.data.stream.FileSource` (random access: decoding workers can read it); anything else is read
    once, in order, a PIL image named ``image N`` by its position."""
    if isinstance(images, list | tuple) and not any(isinstance(img, Image.Image) for img in images):
        return FileSource([os.fspath(img) for img in images])
    return (
        (img, f"image {i}", -1) if isinstance(img, Image.Image) else (os.fspath(img), os.fspath(img), -1)
        for i, img in enumerate(images)
    )


@dataclass
class Job:
    """One batch job: its ``source`` (an :class:`~vitkit.data.stream.ImageSource`, taken at ``positions``
    (default all), shardable and resumable; or an iterable of items, read once in order, by every process
    whole), the ``engine`` (a spec, built once the decoding has started, or holding an engine already built), the batch
    and the decoding (``workers`` processes, ``prefetch`` batches ahead, ``skip_bad``, ``decode`` cpu/gpu/auto:
    :func:`plan_decode`), the progress bar (``desc``), ``where`` its output is (for errors), ``on_engine``
    (called with the engine once built, on process 0) and the processes of a ``torchrun`` job (``dist``)."""

    source: ImageSource | Items
    engine: EngineSpec
    batch_size: int = 32
    positions: Sequence[int] | None = None
    workers: int | None = 0  # None: the default for where the engine runs (EngineSpec.workers)
    prefetch: int = 2
    skip_bad: bool = False
    decode: str = "cpu"
    progress: bool = True
    desc: str = "images"
    where: str = "output"
    on_engine: Callable[[InferenceEngine], None] | None = None
    dist: DistInfo | None = None

    @property
    def info(self) -> DistInfo:
        """The processes that share the job: none for an iterable source (every process reads it whole)."""
        return self.dist if self.dist is not None and isinstance(self.source, ImageSource) else DistInfo()

    def order(self) -> Sequence[int]:
        """The positions of a sized source the job takes, in output order."""
        assert isinstance(self.source, ImageSource)
        return range(len(self.source)) if self.positions is None else self.positions


Task = Callable[[InferenceEngine, StreamBatch], Mapping[str, Any]]  # a batch -> its columns, a value per item


class Collect:
    """A sink in memory: every batch's columns, joined by :meth:`columns` (arrays concatenated, lists joined)."""

    def __init__(self) -> None:
        self.parts: list[Mapping[str, Any]] = []
        self.ids: list[str] = []
        self.done = 0

    def write(self, columns: Mapping[str, Any]) -> None:
        self.parts.append(columns)

    def columns(self) -> dict[str, Any]:
        """The job's columns, one value per item ({} when nothing was written)."""
        return join(self.parts)


Steps = Callable[[Job, Task, JobSummary], Iterator[tuple[list[str], list[str | None], dict[str, Any]]]]


def run_job(job: Job, task: Task, sink: Sink | None, steps: Steps | None = None) -> JobSummary:
    """Run ``task`` over every batch of ``job`` into ``sink``: the one loop of every batch job.

    Rows already in ``sink`` (``sink.ids``) are checked against the input (:func:`check_resume`) and skipped.
    Under ``torchrun`` the positions still to do are dealt out by :func:`vitkit.distributed.shard_steps` and
    process 0 (the only one with a ``sink``) writes every step's rows in input order. ``task(engine, batch)``
    gives the batch's columns, one value per item (failed items included, with ``skip_bad``). Returns the
    :class:`JobSummary` (on process 0, of the whole job). ``steps``: what runs the batches, in place of
    :func:`job_steps` (:func:`vitkit.ray.steps`: the same job on a Ray cluster)."""
    info = job.info
    summary = JobSummary(total=-1)
    if isinstance(job.source, ImageSource):
        order = job.order()
        check_same_input((text_id(job.source.item_id(p)) for p in order), info)  # before any step is taken
        status: tuple[int, str | None] = (0, None)
        if info.is_main:
            assert sink is not None, "process 0 needs a sink"
            try:
                check_resume(sink.ids, job.source, order, job.where)
                status = (sink.done, None)
            except DataError as e:
                status = (0, str(e))
                if not info.enabled:
                    raise
        done, error = broadcast_from_main(status, info)  # every process continues from the same row, or stops
        if error is not None:
            raise DataError(error)
        summary = JobSummary(total=len(order), resumed=done)
        if summary.resumed == summary.total:
            return summary
    start = time.perf_counter()
    for ids, errors, columns in (steps or job_steps)(job, task, summary):
        assert sink is not None
        sink.write(columns)
        summary.written += len(ids)
        for item, err in zip(ids, errors, strict=True):
            if err is not None:
                summary.failed += 1
                if summary.first_failure is None:
                    summary.first_failure = err if err.startswith(item) else f"{item}: {err}"
    if summary.total < 0:
        summary.total = summary.written
    summary.seconds = time.perf_counter() - start
    return summary


def job_steps(
    job: Job, task: Task, summary: JobSummary | None = None
) -> Iterator[tuple[list[str], list[str | None], dict[str, Any]]]:
    """The job's batches through the engine, as (ids, errors, columns) of each step in input order, on process 0
    (nothing on the others: their rows go to process 0). The decoding starts first, from the engine's plan;
    then the engine is built. ``summary`` (resumed rows, total) is filled in with the engine and decoding."""
    info = job.info
    if summary is None:
        summary = JobSummary(total=len(job.order()) if isinstance(job.source, ImageSource) else -1)
    decoded, decoder, steps, build = _start(job, summary.resumed)
    engine = build()
    gpu_decoder = decoder() if decoder is not None else None
    batches = engine.feed(decoded, gpu_decoder)
    first = next(batches, None)  # a bad image among the first is its error line alone, before any other output
    summary.engine, summary.built = engine.describe(), engine
    if job.on_engine is not None and info.is_main:
        job.on_engine(engine)
    total = summary.total if summary.total >= 0 else None
    bar = tqdm(
        total=total, initial=summary.resumed, desc=job.desc, unit="img", file=sys.stderr,
        disable=not (job.progress and info.is_main), smoothing=0.1, dynamic_ncols=True,
    )  # fmt: skip
    share = CpuShare(say=lambda line: tqdm.write(line, file=sys.stderr) if info.is_main else None)
    with bar, contextlib.closing(share):
        step = 0
        while steps < 0 or step < steps:
            share.tick()  # threads follow the cores other programs leave (hardware.CpuShare)
            batch = first if step == 0 else next(batches, None)
            first = None  # no batch is held past its step
            step += 1
            if batch is None and steps < 0:
                break
            mine_rows = None if batch is None else (batch.positions, batch.ids, batch.errors, task(engine, batch))
            gathered = gather_to_main(mine_rows, info)
            merged = None if gathered is None else _in_order([g for g in gathered if g is not None])
            if merged is not None:
                bar.update(len(merged[0]))
                yield merged
    if gpu_decoder is not None:
        summary.decode_note = gpu_decoder.counts.note()


#: Bytes one image of a batch takes at least, in floats per input value and per token and width of the model (the
#: input, and the few (tokens, width) activations a block holds at once): what bounds ``--batch-size``
BATCH_FLOATS_PER_TOKEN_WIDTH = 4


def check_batch_fits(batch_size: int, model: VisionTransformer, preprocess: Preprocess) -> None:
    """ConfigError naming ``--batch-size`` when a batch of ``preprocess``'s images through ``model`` would need
    more than this machine's memory (a batch of 100,000,000 asked for 64 GB in one allocation)."""
    total = total_memory()
    if total is None:
        return
    (h, w), cfg = preprocess.image_size, model.cfg
    tokens = (h // cfg.stride) * (w // cfg.stride) + cfg.num_prefix_tokens
    per_image = 4 * (preprocess.channels * h * w + BATCH_FLOATS_PER_TOKEN_WIDTH * tokens * cfg.hidden_size)
    if batch_size * per_image > total:
        raise ConfigError(
            f"--batch-size {batch_size}: a batch of {h}x{w} images needs about {batch_size * per_image / 2**30:,.0f} "
            f"GiB, more than this machine's {total / 2**30:,.0f} GiB of memory; choose {max(1, total // per_image):,} "
            "or less"
        )


def _start(
    job: Job, resumed: int
) -> tuple[Iterator[StreamBatch], Callable[[], GpuDecoder] | None, int, Callable[[], InferenceEngine]]:
    """The job's decoding started from its engine's plan: (batches, the GPU decoder's maker, the steps every
    process runs (-1: until the source ends), the engine's maker). The transform and the workers follow from the
    plan (full or reduced decode, uint8 and every core for a GPU), the decoding workers start now, and the engine
    is built after, from the same plan."""
    info, spec = job.info, job.engine.on(job.info)
    check_batch_fits(job.batch_size, spec.model, spec.preprocess)
    transform, workers = spec.transform(), spec.workers(job.workers)
    source = job.source
    calibration: Callable[[], torch.Tensor] | None = None
    if isinstance(source, ImageSource):
        todo = job.order()[resumed:]
        worker_transform, decoder = plan_decode(job.decode, transform, spec.plan, source, todo, workers)
        mine, steps = shard_steps(todo, job.batch_size, info)
        decoded = stream_batches(
            source, worker_transform, job.batch_size, positions=mine, workers=workers, prefetch=job.prefetch,
            skip_bad=job.skip_bad,
        )  # fmt: skip
        calibration = lambda: calibration_sample(source, transform)  # noqa: E731
    else:
        decoder, steps = None, -1
        decoded = stream_iterable(source, transform, job.batch_size, skip_bad=job.skip_bad)
    return decoded, decoder, steps, lambda: spec.build(job.batch_size, calibration)


def _in_order(
    parts: list[tuple[np.ndarray, list[str], list[str | None], Mapping[str, Any]]],
) -> tuple[list[str], list[str | None], dict[str, Any]] | None:
    """The rows of one step of every process, in rank order, joined: (ids, errors, columns). Process ``r``'s
    batch of step ``s`` is the input's batch ``s * world + r``, so rank order is input order."""
    if not parts:
        return None
    return [i for p in parts for i in p[1]], [e for p in parts for e in p[2]], join([p[3] for p in parts])


def join(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The columns of several batches as one, each over the batches that have it (a batch whose images all
    failed has no features or logits): arrays concatenated, lists chained ({} for none)."""
    names = dict.fromkeys(name for p in parts for name in p)
    cols = {name: [p[name] for p in parts if name in p] for name in names}
    return {
        n: np.concatenate(c) if isinstance(c[0], np.ndarray) else [v for b in c for v in b] for n, c in cols.items()
    }


def calibration_sample(source: ImageSource, transform: Transform, limit: int = CALIBRATION_MAX_IMAGES) -> torch.Tensor:
    """Up to ``limit`` images spread evenly over ``source``, transformed (OpenVINO int8's calibration set);
    images that fail to decode are left out."""
    n = len(source)
    picked = range(n) if n <= limit else [i * n // limit for i in range(limit)]
    if isinstance(transform, EvalTransform):  # the engines calibrate on normalised images
        transform = dataclasses.replace(transform, uint8=False)
    batches = stream_batches(source, transform, 32, positions=list(picked), skip_bad=True)
    images = [b.images for b in batches if b.images.numel()]
    if not images:
        raise VitkitError("--backend openvino --precision int8: no input image decodes, nothing to calibrate on")
    return torch.cat(images)
