"""The loop every batch job runs (``predict`` now, ``embed`` and sharded runs on the same pieces): a source's
images streamed through an :class:`~vitkit.inference.engine.InferenceEngine` into rows, batch by batch, with a
progress bar, resuming where an earlier run's output stops.

A job is: an :class:`~vitkit.data.stream.ImageSource` (and the ``positions`` of it this process takes), a
transform (:class:`~vitkit.data.eval_transform.EvalTransform` of the checkpoint's preprocessing), a function
building the engine (called once the decoding workers have started, so they decode while the weights are
packed), a function turning a :class:`~vitkit.data.stream.StreamBatch` and the engine into columns, and a sink
that takes the columns (a :class:`~vitkit.outputs.rows.RowWriter`, or anything with ``write(columns)``,
``done`` and ``ids``: printing to the console is one). :func:`run_job` checks that the rows a resumed output
holds are those its input starts with, and continues after them.

Under ``torchrun`` (``dist``: :func:`vitkit.distributed.setup`), the positions still to do are dealt out over
the processes in batches (:func:`vitkit.distributed.shard_steps`: batch ``c`` to process ``c % world``) and process 0,
the only one with a sink, gathers every step's rows and writes them in input order: the output is the file one
process writes, and it resumes the same way (with any number of processes).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from vitkit.data.eval_transform import EvalTransform
from vitkit.data.gpu_decode import (
    DECODES,
    GpuDecoder,
    GpuDecodeTransform,
    choose_decode,
    measure_rates,
    nvimgcodec_module,
)
from vitkit.data.stream import ImageSource, StreamBatch, Transform, stream_batches
from vitkit.distributed import DistInfo, broadcast_from_main, check_same_input, gather_to_main, shard_steps
from vitkit.errors import ConfigError, DataError, VitkitError
from vitkit.fileio import text_id
from vitkit.hardware import resolve_device
from vitkit.inference.engine import InferenceEngine


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

    def failure_note(self) -> str | None:
        """The one-line account of the images that failed (None when none did)."""
        if not self.failed:
            return None
        return f"{self.failed} of {self.written} image(s) failed and are marked as such (first: {self.first_failure})"


def feeds_gpu(device: torch.device | str, backend: str = "torch") -> bool:
    """Whether a job's engine will run on a CUDA device (``device`` as the engine takes it, ``auto`` resolved as
    the engine resolves it; the ONNX engines run on the CPU). Its batches are then uint8 pixels
    (``EvalTransform(uint8=True)``), copied to the GPU straight from the workers' pageable shared memory and
    normalised there. Not page-locked first (``stream_batches(pin_memory=True)``): on an H100 the DataLoader's
    pinning thread took 54 ms a batch of 256 and an 8,192-image eval was 1.0-1.2 s slower with it in each of
    three pairs (BENCHMARKS.md, "GPU"); buffers the workers fill already page-locked would avoid that copy. On
    the CPU the workers keep normalising: normalising a batch in the job's process measured 2.6x the workers'
    per-image cost there (a fresh 154 MB float batch faults in every page), and it would take the model's
    cores."""
    if backend != "torch":
        return False
    return (device if isinstance(device, torch.device) else resolve_device(device)).type == "cuda"


def plan_decode(
    decode: str,
    transform: Transform,
    device: torch.device | str,
    backend: str,
    source: ImageSource,
    positions: Sequence[int],
    workers: int,
) -> tuple[Transform, Callable[[], GpuDecoder] | None]:
    """``--decode`` for a job: the transform its workers run and, when its JPEGs are decoded on the GPU, a
    function giving the :class:`~vitkit.data.gpu_decode.GpuDecoder` (made once, when first called: after the
    engine, so that the workers start before CUDA does). ``gpu`` needs a CUDA job, nvImageCodec and the fast
    path (``--precision fp32`` is Pillow's decode bit for bit): else one-line ConfigError. ``auto``: the GPU
    where :func:`~vitkit.data.gpu_decode.choose_decode` measures it faster on the job's first JPEGs."""
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
            dev = device if isinstance(device, torch.device) else resolve_device(device)
            made.append(GpuDecoder(cpu.preprocess, nvimgcodec_module(), dev))
        return made[0]

    gpu_job = feeds_gpu(device, backend)
    if not choose_decode(decode, gpu_job, rates=lambda: measure_rates(source, positions, cpu, decoder(), workers)):
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


def run_job(
    source: ImageSource,
    transform: Transform,
    build: Callable[[], InferenceEngine],
    rows: Callable[[InferenceEngine, StreamBatch], Mapping[str, Any]],
    sink: Sink | None,
    *,
    batch_size: int,
    positions: Sequence[int] | None = None,
    workers: int = 0,
    prefetch: int = 2,
    skip_bad: bool = False,
    progress: bool = True,
    desc: str = "images",
    where: str = "output",
    on_engine: Callable[[InferenceEngine], None] | None = None,
    dist: DistInfo | None = None,
    decoder: Callable[[], GpuDecoder] | None = None,
) -> JobSummary:
    """Stream ``source`` (at ``positions``, default all) through the engine ``build`` returns into ``sink``.

    Rows already in ``sink`` (``sink.ids``) are checked against the input (:func:`check_resume`) and skipped.
    The decoding workers start before ``build`` is called; ``on_engine`` is called with the engine once built
    (the commands print its description there). ``rows(engine, batch)`` gives the batch's columns, one value
    per item of the batch (failed items included, with ``skip_bad``; a column is a list or an array). A bad
    image raises DataError naming it unless ``skip_bad``. ``dist``: the processes of a ``torchrun`` job (see the
    module docstring); only process 0 has a ``sink`` (None elsewhere), a progress bar and ``on_engine``.
    On a CUDA engine, its :meth:`~vitkit.inference.engine.InferenceEngine.feed` copies each batch to the device
    while the previous one is computed; ``decoder`` (from :func:`plan_decode`, with the transform it gave)
    decodes the batches' JPEGs there. Returns the :class:`JobSummary` (on process 0, of the whole job)."""
    info = dist or DistInfo()
    order: Sequence[int] = range(len(source)) if positions is None else positions
    check_same_input((text_id(source.item_id(p)) for p in order), info)  # before any step is taken
    status: tuple[int, str | None] = (0, None)
    if info.is_main:
        assert sink is not None, "process 0 needs a sink"
        try:
            check_resume(sink.ids, source, order, where)
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
    mine, steps = shard_steps(order[done:], batch_size, info)
    decoded = stream_batches(
        source, transform, batch_size, positions=mine, workers=workers, prefetch=prefetch, skip_bad=skip_bad,
    )  # fmt: skip
    engine = build()
    gpu_decoder = decoder() if decoder is not None else None
    batches = engine.feed(decoded, gpu_decoder)
    first = next(batches, None)  # a bad image among the first is its error line alone, before any other output
    summary.engine = engine.describe()
    if on_engine is not None and info.is_main:
        on_engine(engine)
    bar = tqdm(
        total=summary.total, initial=summary.resumed, desc=desc, unit="img", file=sys.stderr,
        disable=not (progress and info.is_main), smoothing=0.1, dynamic_ncols=True,
    )  # fmt: skip
    with bar:
        for step in range(steps):
            batch = first if step == 0 else next(batches, None)
            mine_rows = None if batch is None else (batch.positions, batch.ids, batch.errors, rows(engine, batch))
            gathered = gather_to_main(mine_rows, info)
            if gathered is None:  # not process 0: its rows went to process 0
                continue
            merged = _in_order([g for g in gathered if g is not None])
            if merged is None:
                continue
            ids, errors, columns = merged
            assert sink is not None
            sink.write(columns)
            summary.written += len(ids)
            for item, err in zip(ids, errors, strict=True):
                if err is not None:
                    summary.failed += 1
                    if summary.first_failure is None:
                        summary.first_failure = err if err.startswith(item) else f"{item}: {err}"
            bar.update(len(ids))
    summary.seconds = time.perf_counter() - start
    if gpu_decoder is not None:
        summary.decode_note = gpu_decoder.counts.note()
    return summary


def _in_order(
    parts: list[tuple[np.ndarray, list[str], list[str | None], Mapping[str, Any]]],
) -> tuple[list[str], list[str | None], dict[str, Any]] | None:
    """The rows of one step of every process, merged into input order (by position): (ids, errors, columns)."""
    if not parts:
        return None
    if len(parts) == 1:
        return list(parts[0][1]), list(parts[0][2]), dict(parts[0][3])
    order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
    ids = [i for p in parts for i in p[1]]
    errors = [e for p in parts for e in p[2]]
    columns: dict[str, Any] = {}
    for name in parts[0][3]:
        values = [p[3][name] for p in parts]
        if isinstance(values[0], np.ndarray):
            columns[name] = np.concatenate(values)[order]
        else:
            flat = [v for vs in values for v in vs]
            columns[name] = [flat[i] for i in order]
    return [ids[i] for i in order], [errors[i] for i in order], columns


def calibration_sample(source: ImageSource, transform: Transform, limit: int = 300) -> torch.Tensor:
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
