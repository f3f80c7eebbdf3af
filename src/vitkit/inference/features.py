"""Batched forward passes over a dataset: logits and frozen pre-logits features, with a progress bar.

Works with any dataset that follows vitkit's data interface: map-style (``__len__`` and ``__getitem__ ->
(PIL image, label)``) or iterable-only (streaming shards), preprocessed with the checkpoint's
:class:`~vitkit.checkpoints.preprocess.Preprocess` (:class:`~vitkit.data.eval_transform.EvalTransform`),
decoded as needed (:mod:`vitkit.data.stream`) and run on the :class:`~vitkit.inference.engine.InferenceEngine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.stream import DatasetSource, StreamBatch
from vitkit.distributed import DistInfo, broadcast_from_main
from vitkit.errors import ConfigError, DataError
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.jobs import Collect, EngineSpec, Job, engine_spec, run_job
from vitkit.models.vit import VisionTransformer


def is_map_style(dataset: Any) -> bool:
    """Whether the dataset supports ``len`` and random access (else it is streamed in order)."""
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


@dataclass
class Extracted:
    """Per-example outputs of :func:`extract`, in the order the examples were visited."""

    labels: np.ndarray  # (N,) int64
    indices: np.ndarray  # (N,) int64 dataset indices
    logits: np.ndarray | None = None  # (N, K) float32
    features: np.ndarray | None = None  # (N, R) float32, pre-logits representation
    engine: InferenceEngine | None = None  # what computed them (its precision and path, for a report)
    decode_note: str | None = None  # with --decode gpu: what decoded the images (DecodeCounts.note)


def extract(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    dataset: Any,
    preprocess: Preprocess,
    *,
    logits: bool = True,
    features: bool = False,
    batch_size: int = 64,
    device: torch.device | str | None = "cpu",
    indices: Sequence[int] | None = None,
    workers: int = 0,
    desc: str = "extract",
    progress: bool = True,
    precision: str = "fp32",
    backend: str = "torch",
    on_engine: Callable[[InferenceEngine], None] | None = None,
    dist: DistInfo | None = None,
    decode: str = "cpu",
) -> Extracted:
    """Run the model over a dataset in batches, collecting logits and/or pre-logits features.

    Features are the frozen representation the paper's linear probes use: the pooled token after the
    optional pre-logits layer (``forward_head(tokens, pre_logits=True)``).

    ``model``: a model, run on an :class:`~vitkit.inference.engine.InferenceEngine` built here in
    ``precision`` (default ``fp32``: the model itself, exactly) on ``backend`` and ``device`` (``on_engine`` is
    called with it once built), or an engine already built, or the spec of one (``precision``, ``backend`` and
    ``device`` are then its own; :func:`~vitkit.inference.jobs.engine_spec`). A map-style dataset is decoded by
    ``workers`` processes (0: this one), which start before the engine is built; ``indices`` restricts it to
    those examples. An iterable-only dataset is streamed in order.

    ``dist``: the processes of a ``torchrun`` job. Each extracts its share of a map-style dataset (the batch
    jobs' sharding, :func:`vitkit.inference.jobs.run_job`) and every process gets the whole result, in the
    order one process gives (an iterable-only dataset is extracted whole by every process).

    ``decode``: where JPEGs are decoded, ``cpu`` (default), ``gpu`` or ``auto``
    (:func:`vitkit.inference.jobs.plan_decode`).
    """
    if not (logits or features):
        raise ValueError("nothing to extract: ask for logits, features or both")
    engine = engine_spec(model, preprocess, precision=precision, backend=backend, device=device)
    if logits and engine.model.cfg.num_classes <= 0:
        raise ConfigError("the model has no classification head (num_classes=0); logits are not defined")
    if not is_map_style(dataset) and indices is not None:
        raise DataError("this dataset can only be streamed; selecting examples by index needs a map-style dataset")
    source: Any = (
        DatasetSource(dataset)
        if is_map_style(dataset)
        else ((img, str(i), int(label)) for i, (img, label) in enumerate(dataset))
    )
    job = Job(source, engine, batch_size, positions=indices, workers=workers, decode=decode, progress=progress,
              desc=desc, where="the dataset", on_engine=on_engine, dist=dist)  # fmt: skip

    def outputs(e: InferenceEngine, b: StreamBatch) -> dict[str, np.ndarray]:
        out = e.forward(b.images, logits=logits, features=features)
        cols = {"labels": b.labels, "indices": b.positions}
        if features:
            assert out.features is not None
            cols["features"] = out.features.numpy()  # (B, R)
        if logits:
            assert out.logits is not None
            cols["logits"] = out.logits.numpy()  # (B, K)
        return cols

    sink = Collect() if job.info.is_main else None
    summary = run_job(job, outputs, sink)
    cols = broadcast_from_main(sink.columns() if sink is not None else None, job.info)  # every process: the whole
    if not cols:
        raise DataError("the dataset has no examples")
    return Extracted(**cols, engine=summary.built, decode_note=summary.decode_note)
