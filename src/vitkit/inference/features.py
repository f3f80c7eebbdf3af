"""Batched forward passes over a dataset: logits and frozen pre-logits features, with a progress bar.

Works with any dataset that follows vitkit's data interface: map-style (``__len__`` and ``__getitem__ ->
(PIL image, label)``) or iterable-only (streaming shards), preprocessed with the checkpoint's
:class:`~vitkit.checkpoints.preprocess.Preprocess` (:class:`~vitkit.data.eval_transform.EvalTransform`),
decoded as needed (:mod:`vitkit.data.stream`) and run on the :class:`~vitkit.inference.engine.InferenceEngine`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.eval_transform import EvalTransform
from vitkit.data.stream import DatasetSource, StreamBatch, stream_batches, stream_iterable
from vitkit.distributed import DistInfo, all_gather, check_same_input, shard_of
from vitkit.errors import ConfigError, DataError
from vitkit.hardware import resolve_device
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.jobs import calibration_sample, feeds_gpu, plan_decode
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
    model: VisionTransformer | InferenceEngine,
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
    called with it once built), or an engine already built (``precision``, ``backend`` and ``device`` are then
    its own). A map-style dataset is decoded by ``workers`` processes (0: this one), which start before the
    engine is built; ``indices`` restricts it to those examples. An iterable-only dataset is streamed in order.

    ``dist``: the processes of a ``torchrun`` job. Each extracts every ``world``-th batch of a map-style
    dataset (from its rank on) and every process gets the whole result, in the order one process gives (an
    iterable-only dataset is extracted whole by every process).

    ``decode``: where JPEGs are decoded, ``cpu`` (default), ``gpu`` or ``auto``
    (:func:`vitkit.inference.jobs.plan_decode`).
    """
    info = dist or DistInfo()
    if not (logits or features):
        raise ValueError("nothing to extract: ask for logits, features or both")
    if not isinstance(model, InferenceEngine) and logits and model.cfg.num_classes <= 0:
        raise ConfigError("the model has no classification head (num_classes=0); logits are not defined")
    reference = not model.reduced_decode if isinstance(model, InferenceEngine) else precision == "fp32"
    if isinstance(model, InferenceEngine):
        gpu = model.device.type == "cuda"
    else:
        gpu = feeds_gpu(info.device if info.enabled else (device if device is not None else "auto"), backend)
    # on a GPU: uint8 batches, normalised on the GPU (jobs.feeds_gpu)
    transform = EvalTransform(preprocess, reference=reference and backend == "torch", uint8=gpu)
    if isinstance(model, InferenceEngine):
        job_device: torch.device | str = model.device
    else:
        job_device = info.device if info.enabled else (device if device is not None else "auto")
    map_style = is_map_style(dataset)
    everything: Sequence[int] = range(len(dataset)) if map_style else []
    worker_transform, decoder = plan_decode(
        decode, transform, job_device, backend, DatasetSource(dataset), everything if indices is None else indices,
        workers,
    )  # fmt: skip
    total = None
    batches: Iterator[StreamBatch]
    if is_map_style(dataset):
        wanted: Sequence[int] = range(len(dataset)) if indices is None else indices
        total = len(wanted)
        if info.enabled:
            source = DatasetSource(dataset)
            check_same_input((source.item_id(i) for i in wanted), info, "the dataset")
        mine = [wanted[j] for j in shard_of(total, batch_size, info)] if info.enabled else wanted
        batches = stream_batches(
            DatasetSource(dataset),
            worker_transform,
            batch_size,
            positions=mine,
            workers=workers,
        )
    elif indices is not None:
        raise DataError("this dataset can only be streamed; selecting examples by index needs a map-style dataset")
    else:
        items = ((img, str(i), int(label)) for i, (img, label) in enumerate(dataset))
        batches = stream_iterable(items, worker_transform, batch_size)
    engine = model
    if not isinstance(engine, InferenceEngine):
        dev = device if isinstance(device, torch.device) else resolve_device(device)
        calibrate = (lambda: calibration_sample(DatasetSource(dataset), transform)) if total is not None else None
        engine = InferenceEngine(
            engine, preprocess, precision=precision, backend=backend, batch_size=batch_size, calibration=calibrate,
            device=info.device if info.enabled else dev,
        )  # fmt: skip
        if on_engine is not None and info.is_main:
            on_engine(engine)
    out_logits: list[np.ndarray] = []
    out_feats: list[np.ndarray] = []
    out_labels: list[np.ndarray] = []
    out_idx: list[np.ndarray] = []
    show = progress and info.is_main
    gpu_decoder = decoder() if decoder is not None else None
    with tqdm(desc=desc, total=total, unit="img", file=sys.stderr, disable=not show) as bar:
        for b in engine.feed(batches, gpu_decoder):  # on a GPU: copied one batch ahead, normalised there
            out = engine.forward(b.images, logits=logits, features=features)
            if features:
                assert out.features is not None
                out_feats.append(out.features.numpy())  # (B, R)
            if logits:
                assert out.logits is not None
                out_logits.append(out.logits.numpy())  # (B, K)
            out_labels.append(b.labels)
            out_idx.append(b.positions)
            bar.update(len(b) * (info.world if info.enabled and total is not None else 1))
    note = gpu_decoder.counts.note() if gpu_decoder is not None else None
    if info.enabled and total is not None:  # every process's share, interleaved back into the one order
        shares = all_gather((out_labels, out_idx, out_logits, out_feats), info)
        return dataclasses.replace(_interleave(shares, batch_size, logits, features), engine=engine, decode_note=note)
    if not out_labels:
        raise DataError("the dataset has no examples")
    return Extracted(
        labels=np.concatenate(out_labels),
        indices=np.concatenate(out_idx),
        logits=np.concatenate(out_logits) if logits else None,
        features=np.concatenate(out_feats) if features else None,
        engine=engine,
        decode_note=note,
    )


def _interleave(shares: list[Any], batch_size: int, logits: bool, features: bool) -> Extracted:
    """The per-process results of a sharded :func:`extract` (process ``r`` took every ``world``-th batch from the
    ``r``-th on, :func:`vitkit.distributed.shard_of`), merged back into the order of the examples."""
    world = len(shares)
    parts = [[np.concatenate(a) if a else None for a in share] for share in shares]
    n = sum(0 if p[0] is None else len(p[0]) for p in parts)
    if n == 0:
        raise DataError("the dataset has no examples")

    def merged(j: int) -> np.ndarray:
        got: list[tuple[int, np.ndarray]] = []
        for r, p in enumerate(parts):
            a = p[j]
            if a is not None:
                got.append((r, a))
        first = got[0][1]
        out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
        for r, share in got:
            out[shard_of(n, batch_size, DistInfo(rank=r, world=world))] = share
        return out

    return Extracted(
        labels=merged(0),
        indices=merged(1),
        logits=merged(2) if logits else None,
        features=merged(3) if features else None,
    )
