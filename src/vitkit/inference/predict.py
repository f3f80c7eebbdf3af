"""Classify images with a checkpoint: ``vitkit.predict(...)`` in Python, and :func:`predict_job` behind
``vitkit predict`` (any number of images, streamed, to the console or to a JSONL/CSV/Parquet file, resumable).

Both run the :class:`~vitkit.inference.engine.InferenceEngine` over images streamed by
:mod:`vitkit.data.stream`: decoded as they are needed, so memory stays bounded by the batch and prefetch
whatever the number of images.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.data.stream import ImageSource, StreamBatch
from vitkit.distributed import DistInfo
from vitkit.errors import VitkitError
from vitkit.images import ImageInput
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.jobs import EngineSpec, Job, JobSummary, Steps, image_source, job_steps, run_job
from vitkit.inference.provenance import job_meta
from vitkit.outputs.rows import ColumnsError, Field, open_rows
from vitkit.textids import printable


@dataclass
class Prediction:
    """The ``top`` labels of one image, most probable first, as (label, probability); ``error`` the reason it
    could not be read (``skip_bad``; ``top`` is then empty)."""

    image: str
    top: list[tuple[str, float]]
    error: str | None = None


def prediction_fields(top_k: int, num_classes: int, *, logits: bool = False, errors: bool = False) -> list[Field]:
    """The columns of a prediction output: ``index`` (the image's position in the input), ``image`` (its id:
    path, shard member or dataset row), the top-k ``labels``, class indices (``classes``) and ``probs``; with
    ``logits`` all K logits; with ``errors`` an ``error`` column (empty for images that were read)."""
    k = min(top_k, num_classes)
    fields = [
        Field("index", "int"),
        Field("image", "str"),
        Field("labels", "str_list", k),
        Field("classes", "int_list", k),
        Field("probs", "float_list", k),
    ]
    if logits:
        fields.append(Field("logits", "float_list", num_classes))
    if errors:
        fields.append(Field("error", "str"))
    return fields


def prediction_columns(
    engine: InferenceEngine, batch: StreamBatch, top_k: int, *, logits: bool = False, errors: bool = False
) -> dict[str, list[Any]]:
    """One batch through the engine, as the columns of :func:`prediction_fields` (a failed image: no labels,
    probabilities or logits, and its error). The logits come back from the device once per batch, and the
    columns are made per batch (numpy indexing and one ``tolist`` each), not image by image."""
    cols: dict[str, list[Any]] = {"index": batch.positions.tolist(), "image": list(batch.ids)}
    names = ["labels", "classes", "probs"] + (["logits"] if logits else [])
    values: dict[str, list[Any]] = {name: [] for name in names}
    if batch.images.numel():
        out = engine.logits(batch.images)  # (G, K) float32, on the CPU
        top_p, top_i = out.softmax(dim=-1).topk(min(top_k, engine.num_classes), dim=-1)  # (G, k)
        classes = top_i.numpy()
        values["labels"] = engine.label_names()[classes].tolist()
        values["classes"] = classes.tolist()
        values["probs"] = top_p.numpy().tolist()
        if logits:
            values["logits"] = out.numpy().tolist()
    ok = batch.ok
    for name in names:  # failed images (skip_bad): None in their rows
        cols[name] = values[name] if ok.all() else _spread(values[name], ok)
    if errors:
        cols["error"] = [e or "" for e in batch.errors]
    return cols


def _spread(values: list[Any], ok: np.ndarray) -> list[Any]:
    """``values`` of the images that decoded, placed at their rows (``ok``); None in the others."""
    out: list[Any] = [None] * len(ok)
    for j, v in zip(np.flatnonzero(ok).tolist(), values, strict=True):
        out[j] = v
    return out


def _predictions(cols: Mapping[str, list[Any]]) -> list[Prediction]:
    errors = cols.get("error") or [""] * len(cols["image"])
    return [
        Prediction(img, [] if labels is None else list(zip(labels, probs, strict=True)), err or None)
        for img, labels, probs, err in zip(cols["image"], cols["labels"], cols["probs"], errors, strict=True)
    ]


@overload  # a list in, a list out; any other iterable (a generator) in, a generator out
def predict(  # type: ignore[overload-overlap]
    checkpoint: str | os.PathLike[str] | Loaded,
    images: list[ImageInput] | tuple[ImageInput, ...],
    *,
    top_k: int = ...,
    batch_size: int = ...,
    format: str | None = ...,
    progress: bool = ...,
    precision: str = ...,
    backend: str = ...,
    device: torch.device | str = ...,
    workers: int = ...,
    skip_bad: bool = ...,
) -> list[Prediction]: ...


@overload
def predict(
    checkpoint: str | os.PathLike[str] | Loaded,
    images: Iterable[ImageInput],
    *,
    top_k: int = ...,
    batch_size: int = ...,
    format: str | None = ...,
    progress: bool = ...,
    precision: str = ...,
    backend: str = ...,
    device: torch.device | str = ...,
    workers: int = ...,
    skip_bad: bool = ...,
) -> Iterator[Prediction]: ...


def predict(
    checkpoint: str | os.PathLike[str] | Loaded,
    images: Iterable[ImageInput],
    *,
    top_k: int = 5,
    batch_size: int = 32,
    format: str | None = None,
    progress: bool = False,
    precision: str = "fp32",
    backend: str = "torch",
    device: torch.device | str = "cpu",
    workers: int = 0,
    skip_bad: bool = False,
) -> list[Prediction] | Iterator[Prediction]:
    """Top-``top_k`` labels with softmax probabilities for each image (file path or PIL image).

    ``checkpoint``: any supported checkpoint (or an already loaded one); its preprocessing is applied and its
    class names label the output. A list or tuple of images gives a list of predictions; any other iterable (a
    generator) gives a generator, reading the images as it goes, ``batch_size`` at a time. Images are decoded
    as they are needed (never all at once); ``workers`` > 0 decodes a list of files in that many processes.

    ``precision``: ``fp32`` (default: the checkpoint's own model, the same numbers as ever), ``auto``, ``bf16``
    or ``int8`` (the fast path, see :class:`~vitkit.inference.engine.InferenceEngine`); ``backend``: ``torch``,
    ``onnxruntime``, ``openvino`` or ``auto``. A bad image raises DataError naming it; with ``skip_bad`` its
    prediction has an empty ``top`` and the ``error``.
    """
    loaded = checkpoint if isinstance(checkpoint, Loaded) else load_checkpoint(checkpoint, format=format)
    if loaded.model.cfg.num_classes <= 0:
        where = loaded.meta.source if isinstance(checkpoint, Loaded) else os.fspath(checkpoint)
        raise VitkitError(f"{where}: the model has no classification head; nothing to predict")
    spec = EngineSpec.of(loaded, precision=precision, backend=backend, device=device)
    built = EngineSpec.of_engine(spec.build(batch_size, None))  # now: a bad option is an error of this call
    job = Job(image_source(images), built, batch_size, workers=workers, skip_bad=skip_bad, progress=progress,
              desc="predict")  # fmt: skip
    steps = job_steps(job, lambda engine, batch: prediction_columns(engine, batch, top_k, errors=True))
    found = (p for _, _, columns in steps for p in _predictions(columns))
    return list(found) if isinstance(images, list | tuple) else found


# ---- the job behind ``vitkit predict`` -------------------------------------------------------------------


@dataclass(frozen=True)
class PredictOptions:
    """How ``vitkit predict`` runs: the engine (precision, backend, device, batch), the decoding (workers,
    prefetch, skip_bad) and what each row holds (top_k, logits)."""

    top_k: int = 5
    batch_size: int = 32
    precision: str = "auto"
    backend: str = "torch"
    device: str = "cpu"
    workers: int = 0
    prefetch: int = 2
    skip_bad: bool = False
    logits: bool = False
    progress: bool = True
    decode: str = "auto"  # cpu, gpu or auto: where JPEGs are decoded (vitkit.inference.jobs.plan_decode)


class ConsoleRows:
    """A sink that prints rows as ``vitkit predict`` always has: per image its path and the ranked labels, or
    with ``as_json`` one JSON object per line ({"image", "top": [{"label", "prob"}]}); flushed per batch."""

    def __init__(self, as_json: bool, echo: Callable[[str], None]) -> None:
        self.as_json, self.echo = as_json, echo
        self.ids: list[str] = []
        self.done = 0  # nothing to resume: every run prints its rows

    def write(self, columns: Mapping[str, Any]) -> None:
        lines = []
        for p in _predictions(columns):
            if self.as_json:
                doc: dict[str, Any] = {"image": p.image, "top": [{"label": lab, "prob": v} for lab, v in p.top]}
                if p.error:
                    doc["error"] = p.error
                lines.append(json.dumps(doc))
            else:
                lines.append(printable(p.image))  # a file name never drives the terminal
                lines += [f"  {rank}. {printable(lab):<40} {v:7.2%}" for rank, (lab, v) in enumerate(p.top, 1)]
                if p.error:
                    lines.append(f"  failed: {printable(p.error)}")
        self.echo("\n".join(lines))


def predict_job(
    loaded: Loaded,
    source: ImageSource,
    opts: PredictOptions,
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    as_json: bool = False,
    echo: Callable[[str], None] = print,
    on_engine: Callable[[InferenceEngine], None] | None = None,
    dist: DistInfo | None = None,
    steps: Steps | None = None,
    engine: EngineSpec | None = None,
) -> JobSummary:
    """``vitkit predict``: every image of ``source`` through the engine, the rows (:func:`prediction_fields`)
    written to ``out`` (.jsonl, .csv or .parquet, per batch; ``resume`` continues it, ``overwrite`` starts it
    again) or printed (:class:`ConsoleRows`). OpenVINO's int8 is calibrated on up to 300 of the input's own
    images. ``dist``: the processes of a ``torchrun`` job, each predicting its share of the images, process 0
    writing every row in input order (:func:`~vitkit.inference.jobs.run_job`). ``steps``: what runs the batches
    (:func:`vitkit.ray.steps`: the same job on a Ray cluster, the same rows written). ``engine``: the spec to run
    instead of the one planned from ``loaded`` and ``opts`` (an engine built beforehand, with its own plan:
    :meth:`EngineSpec.of_engine`; the seam through which ``benchmarks/pipeline.py`` runs its no-op model)."""
    info = dist or DistInfo()
    if loaded.model.cfg.num_classes <= 0:
        raise VitkitError(f"{loaded.meta.source}: the model has no classification head; nothing to predict")
    spec = engine or EngineSpec.of(loaded, precision=opts.precision, backend=opts.backend, device=opts.device)
    job = Job(source, spec, opts.batch_size, workers=opts.workers, prefetch=opts.prefetch, skip_bad=opts.skip_bad,
              decode=opts.decode, progress=opts.progress, desc="predict", where=f"--out {out}", on_engine=on_engine,
              dist=info)  # fmt: skip
    sink: Any = None  # on process 0 only: the others' rows go to process 0
    if info.is_main and out is not None:
        meta = {"vitkit.job": "predict", **job_meta(loaded, source, precision=opts.precision, backend=opts.backend)}
        sink = _open_output(out, loaded.model.cfg.num_classes, opts, resume, overwrite, meta)
    elif info.is_main:
        sink = ConsoleRows(as_json, echo)

    def rows(engine: InferenceEngine, batch: StreamBatch) -> dict[str, list[Any]]:
        return prediction_columns(engine, batch, opts.top_k, logits=opts.logits, errors=True)  # the sink picks

    try:
        return run_job(job, rows, sink, steps)
    finally:
        close = getattr(sink, "close", None)
        if close is not None:
            close()


def _open_output(
    out: str | os.PathLike[str], classes: int, opts: PredictOptions, resume: bool, overwrite: bool, meta: dict[str, str]
) -> Any:
    """The prediction output's writer: an ``error`` column with ``skip_bad``. An output resumed with another
    ``--skip-bad`` than it was started with keeps its own columns: one started without it (stopped at an image
    that would not decode, say) continues with ``--skip-bad``, its failed rows empty (and counted at the end);
    one started with it keeps writing its ``error`` column."""
    fields = prediction_fields(opts.top_k, classes, logits=opts.logits, errors=opts.skip_bad)
    try:
        return open_rows(out, fields, id_field="image", resume=resume, overwrite=overwrite, meta=meta)
    except ColumnsError as first:
        if not resume:
            raise
        other = prediction_fields(opts.top_k, classes, logits=opts.logits, errors=not opts.skip_bad)
        try:
            return open_rows(out, other, id_field="image", resume=True, overwrite=False, meta=meta)
        except ColumnsError:
            raise first from None
