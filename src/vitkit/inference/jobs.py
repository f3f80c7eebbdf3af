"""The loop every batch job runs (``predict`` now, ``embed`` and sharded runs on the same pieces): a source's
images streamed through an :class:`~vitkit.inference.engine.InferenceEngine` into rows, batch by batch, with a
progress bar, resuming where an earlier run's output stops.

A job is: an :class:`~vitkit.data.stream.ImageSource` (and the ``positions`` of it this process takes), a
transform (:class:`~vitkit.data.eval_transform.EvalTransform` of the checkpoint's preprocessing), a function
building the engine (called once the decoding workers have started, so they decode while the weights are
packed), a function turning a :class:`~vitkit.data.stream.StreamBatch` and the engine into columns, and a sink
that takes the columns (a :class:`~vitkit.inference.writers.RowWriter`, or anything with ``write(columns)``,
``done`` and ``ids``: printing to the console is one). :func:`run_job` checks that the rows a resumed output
holds are those its input starts with, and continues after them.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tqdm import tqdm

from vitkit.data.stream import ImageSource, StreamBatch, Transform, stream_batches
from vitkit.errors import DataError, VitkitError
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

    def failure_note(self) -> str | None:
        """The one-line account of the images that failed (None when none did)."""
        if not self.failed:
            return None
        return f"{self.failed} of {self.written} image(s) failed and are marked as such (first: {self.first_failure})"


def check_resume(ids: Sequence[str], source: ImageSource, positions: Sequence[int], where: str) -> None:
    """The rows already in an output (their ``ids``) must be those of the job's first positions, in order:
    else DataError naming the first that differs (the input changed; ``where`` names the output)."""
    if len(ids) > len(positions):
        raise DataError(f"{where}: holds {len(ids)} rows but the input has {len(positions)} images; not this input")
    for i, (got, pos) in enumerate(zip(ids, positions, strict=False)):
        want = source.item_id(pos)
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
    sink: Sink,
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
) -> JobSummary:
    """Stream ``source`` (at ``positions``, default all) through the engine ``build`` returns into ``sink``.

    Rows already in ``sink`` (``sink.ids``) are checked against the input (:func:`check_resume`) and skipped.
    The decoding workers start before ``build`` is called; ``on_engine`` is called with the engine once built
    (the commands print its description there). ``rows(engine, batch)`` gives the batch's columns, one value
    per item of the batch (failed items included, with ``skip_bad``). A bad image raises DataError naming it
    unless ``skip_bad``. Returns the :class:`JobSummary`."""
    order: Sequence[int] = range(len(source)) if positions is None else positions
    check_resume(sink.ids, source, order, where)
    summary = JobSummary(total=len(order), resumed=sink.done)
    if summary.resumed == summary.total:
        return summary
    start = time.perf_counter()
    batches = stream_batches(
        source, transform, batch_size, positions=order, start=sink.done, workers=workers, prefetch=prefetch,
        skip_bad=skip_bad,
    )  # fmt: skip
    engine = build()
    first = next(batches, None)  # a bad image among the first is its error line alone, before any other output
    summary.engine = engine.describe()
    if on_engine is not None:
        on_engine(engine)
    bar = tqdm(
        total=summary.total, initial=summary.resumed, desc=desc, unit="img", file=sys.stderr, disable=not progress,
        smoothing=0.1, dynamic_ncols=True,
    )  # fmt: skip
    with bar:
        for batch in itertools.chain([first] if first is not None else [], batches):
            sink.write(rows(engine, batch))
            summary.written += len(batch)
            for item, err in zip(batch.ids, batch.errors, strict=True):
                if err is not None:
                    summary.failed += 1
                    if summary.first_failure is None:
                        summary.first_failure = err if err.startswith(item) else f"{item}: {err}"
            bar.update(len(batch))
    summary.seconds = time.perf_counter() - start
    return summary


def calibration_sample(source: ImageSource, transform: Transform, limit: int = 300) -> torch.Tensor:
    """Up to ``limit`` images spread evenly over ``source``, transformed (OpenVINO int8's calibration set);
    images that fail to decode are left out."""
    n = len(source)
    picked = range(n) if n <= limit else [i * n // limit for i in range(limit)]
    batches = stream_batches(source, transform, 32, positions=list(picked), skip_bad=True)
    images = [b.images for b in batches if b.images.numel()]
    if not images:
        raise VitkitError("--backend openvino --precision int8: no input image decodes, nothing to calibrate on")
    return torch.cat(images)
