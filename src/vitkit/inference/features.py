"""Batched forward passes over a dataset: logits and frozen pre-logits features, with a progress bar.

Works with any dataset that follows vitkit's data interface: map-style (``__len__`` and ``__getitem__ ->
(PIL image, label)``) or iterable-only (streaming shards), preprocessed with the checkpoint's
:class:`~vitkit.checkpoints.preprocess.Preprocess` (:class:`~vitkit.data.eval_transform.EvalTransform`),
decoded as needed (:mod:`vitkit.data.stream`) and run on the :class:`~vitkit.inference.engine.InferenceEngine`.

The evaluators' one features provider (as big_vision's evaluators share one): ``eval``, ``fewshot``, ``knn``,
``analyze`` and the feature cache take one :class:`ExtractOptions` (the data's decoding, the batch, the engine's
precision, backend and device, the processes) and read every split through one :class:`FeatureProvider`, which
builds its engine once, through the job runner (:func:`~vitkit.inference.jobs.run_job`), for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.stream import DatasetSource, StreamBatch
from vitkit.distributed import DistInfo, broadcast_from_main
from vitkit.errors import ConfigError, DataError
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.jobs import Collect, EngineSpec, Job, Task, engine_spec, run_job
from vitkit.models.vit import VisionTransformer


@dataclass(frozen=True)
class ExtractOptions:
    """How an evaluator's data goes through its engine, given once to ``extract``, ``evaluate_dataset``,
    ``fewshot_dataset``, ``knn_dataset`` and ``analyze``.

    ``batch_size`` images a batch, decoded by ``workers`` processes (0: this one; they start before the engine is
    built), JPEGs decoded where ``decode`` says (``cpu``, ``gpu``, ``auto``: :func:`vitkit.inference.jobs.plan_decode`);
    ``skip_bad``: an image that does not decode is left out, counted in the result's notes, instead of stopping
    the job (open the dataset with ``predecode=False``, so that nothing is decoded before the stream starts).
    The engine: ``precision`` (default ``fp32``: the model itself, the reference numbers) on ``backend`` and
    ``device`` (None: ``auto``); ignored for an engine already built. ``on_engine``: called with the engine once,
    when it is first used (on process 0). ``dist``: the processes of a ``torchrun`` job, each extracting its
    share of a map-style dataset (every process gets the whole result)."""

    batch_size: int = 64
    workers: int = 0
    decode: str = "cpu"
    skip_bad: bool = False
    precision: str = "fp32"
    backend: str = "torch"
    device: torch.device | str | None = "cpu"
    progress: bool = True
    on_engine: Callable[[InferenceEngine], None] | None = field(default=None, compare=False)
    dist: DistInfo | None = None


EXTRACT_DEFAULTS = ExtractOptions()  # the options when none are given (one batch of 64 on the CPU, fp32)


@dataclass
class Extracted:
    """Per-example outputs of :func:`extract`, in the order the examples were visited (images that failed with
    ``skip_bad`` left out, said in ``notes``)."""

    labels: np.ndarray  # (N,) int64
    indices: np.ndarray  # (N,) int64 dataset indices
    logits: np.ndarray | None = None  # (N, K) float32
    features: np.ndarray | None = None  # (N, R) float32, pre-logits representation
    engine: InferenceEngine | None = None  # what computed them (its precision and path, for a report)
    decode_note: str | None = None  # with --decode gpu: what decoded the images (DecodeCounts.note)
    failed: list[int] = field(default_factory=list)  # dataset indices of the images that failed (skip_bad)
    notes: list[str] = field(default_factory=list)  # one line when some failed


def source_of(dataset: Any) -> Any:
    """What a job reads of a dataset: a map-style one as a :class:`~vitkit.data.stream.DatasetSource` (random
    access, decoding workers, sharding), an iterable-only one as its items, read once in order."""
    if is_map_style(dataset):
        return DatasetSource(dataset)
    return ((img, str(i), int(label)) for i, (img, label) in enumerate(dataset))


class FeatureProvider:
    """Every split an evaluator reads, through one engine: the spec of ``model`` (a model, an engine already
    built, or a spec: :func:`~vitkit.inference.jobs.engine_spec`) in ``opts``' precision, backend and device,
    built by the first job that runs (its decoding started first) and re-used by the next ones (its weights
    packed once). ``on_engine`` is called once, with the engine the first job ran."""

    def __init__(self, model: VisionTransformer | InferenceEngine | EngineSpec, preprocess: Preprocess,
                 opts: ExtractOptions) -> None:  # fmt: skip
        self.spec = engine_spec(model, preprocess, precision=opts.precision, backend=opts.backend, device=opts.device)
        self.opts = opts
        self.engine: InferenceEngine | None = None

    @property
    def model(self) -> VisionTransformer:
        return self.spec.model

    def run(self, source: Any, task: Task, *, positions: Sequence[int] | None = None, desc: str = "extract") -> Any:
        """``task`` over ``source``'s batches (:func:`~vitkit.inference.jobs.run_job`) into memory: (the joined
        columns, the job's summary); the engine is the provider's."""
        o = self.opts
        spec = self.spec if self.engine is None else EngineSpec.of_engine(self.engine)
        job = Job(source, spec, o.batch_size, positions=positions, workers=o.workers, skip_bad=o.skip_bad,
                  decode=o.decode, progress=o.progress, desc=desc, where="the dataset",
                  on_engine=o.on_engine if self.engine is None else None, dist=o.dist)  # fmt: skip
        sink = Collect() if job.info.is_main else None
        summary = run_job(job, task, sink)
        if summary.built is not None:
            self.engine = summary.built
        cols = broadcast_from_main(sink.columns() if sink is not None else None, job.info)  # every process: all
        return cols, summary

    def extract(
        self,
        dataset: Any,
        *,
        logits: bool = True,
        features: bool = False,
        indices: Sequence[int] | None = None,
        desc: str = "extract",
    ) -> Extracted:
        """:func:`extract` of ``dataset`` on the provider's engine."""
        if not (logits or features):
            raise ValueError("nothing to extract: ask for logits, features or both")
        if logits and self.model.cfg.num_classes <= 0:
            raise ConfigError("the model has no classification head (num_classes=0); logits are not defined")
        if not is_map_style(dataset) and indices is not None:
            raise DataError("this dataset can only be streamed; selecting examples by index needs a map-style dataset")

        def outputs(e: InferenceEngine, b: StreamBatch) -> dict[str, np.ndarray]:
            ok = b.ok
            cols = {"labels": b.labels[ok], "indices": b.positions[ok], "failed": b.positions[~ok]}
            if not ok.any():  # every image of the batch failed (skip_bad): nothing to run
                return cols
            # what was asked for, of the images that decoded: features (G, R), logits (G, K)
            out = e.forward(b.images, logits=logits, features=features)
            return cols | {name: v.numpy() for name, v in vars(out).items() if v is not None}

        cols, summary = self.run(source_of(dataset), outputs, positions=indices, desc=desc)
        if not cols or not len(cols["labels"]):
            raise DataError("the dataset has no examples" + (" that decode" if cols else ""))
        failed = [int(i) for i in cols.pop("failed")]
        first = f" (first: {summary.first_failure})" if summary.first_failure else ""
        total = len(failed) + len(cols["labels"])
        notes = [f"{desc}: {len(failed)} of {total} image(s) did not decode and are left out{first}"] if failed else []
        return Extracted(**cols, engine=self.engine, decode_note=summary.decode_note, failed=failed, notes=notes)


def extract(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    dataset: Any,
    preprocess: Preprocess,
    *,
    logits: bool = True,
    features: bool = False,
    indices: Sequence[int] | None = None,
    desc: str = "extract",
    opts: ExtractOptions = EXTRACT_DEFAULTS,
) -> Extracted:
    """Run the model over a dataset in batches, collecting logits and/or pre-logits features.

    Features are the frozen representation the paper's linear probes use: the pooled token after the
    optional pre-logits layer (``forward_head(tokens, pre_logits=True)``).

    ``model``: a model, run on an :class:`~vitkit.inference.engine.InferenceEngine` built by the job in
    ``opts``' precision, backend and device, or an engine already built, or the spec of one
    (:func:`~vitkit.inference.jobs.engine_spec`). A map-style dataset is decoded by ``opts.workers`` processes
    (0: this one), which start before the engine is built; ``indices`` restricts it to those examples. An
    iterable-only dataset is streamed in order. The rest of ``opts``: :class:`ExtractOptions`.
    """
    return FeatureProvider(model, preprocess, opts).extract(
        dataset, logits=logits, features=features, indices=indices, desc=desc
    )


def is_map_style(dataset: Any) -> bool:
    """Whether the dataset supports ``len`` and random access (else it is streamed in order)."""
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
