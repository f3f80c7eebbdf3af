"""Evaluation runners behind ``vitkit eval`` and ``vitkit fewshot``, callable from Python.

Both take a model, its :class:`~vitkit.checkpoints.preprocess.Preprocess` (from the checkpoint) and datasets that
follow vitkit's data interface (``classes``, ``__len__``, ``__getitem__ -> (PIL image, label)``, or
iterable-only for streams).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.distributed import DistInfo
from vitkit.errors import ConfigError, DataError
from vitkit.evaluate.fewshot import (
    DEFAULT_L2,
    DEFAULT_SHOTS,
    L2_GRID,
    FewShotResult,
    run_episodes,
    sample_episodes,
)
from vitkit.evaluate.metrics import Metrics, compute_metrics, read_label_sets
from vitkit.fileio import check_report_dir, write_text_atomic
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import extract, is_map_style
from vitkit.inference.jobs import EngineSpec, engine_spec
from vitkit.models.vit import VisionTransformer


def align_labels(
    dataset_classes: Sequence[str], model_classes: Sequence[str] | None, num_classes: int
) -> tuple[np.ndarray | None, list[str]]:
    """Map dataset label indices to the model's class indices.

    When both sides name the same classes in a different order, labels are remapped by name; otherwise
    they are used as they are (with a note when the names differ). Returns (mapping or None, notes).
    """
    if len(dataset_classes) != num_classes:
        raise DataError(f"the dataset has {len(dataset_classes)} classes but the model's head has {num_classes}")
    if not model_classes or list(model_classes) == list(dataset_classes):
        return None, []
    if sorted(model_classes) == sorted(dataset_classes):
        index = {name: i for i, name in enumerate(model_classes)}
        return np.array([index[name] for name in dataset_classes], dtype=np.int64), [
            "dataset classes are in a different order from the checkpoint's; labels remapped by class name"
        ]
    differ = [(d, m) for d, m in zip(dataset_classes, model_classes, strict=False) if d != m]
    shown = ", ".join(f"{d!r} vs {m!r}" for d, m in differ[:3]) + (", ..." if len(differ) > 3 else "")
    return None, [
        f"WARNING: the dataset's class names differ from the checkpoint's at {len(differ)} of {num_classes} "
        f"indices (dataset vs checkpoint: {shown}); labels are compared by index, so the accuracy is only "
        "meaningful if each index means the same class on both sides"
    ]


@dataclass
class EvalReport:
    """What ``vitkit eval`` reports: the metrics, the class names they are indexed by, and notes (e.g. classes
    missing from the split)."""

    metrics: Metrics
    class_names: list[str]
    notes: list[str] = field(default_factory=list)
    precision: str | None = None  # what the logits were computed in: "fp32", "bf16" or "int8"
    engine: str | None = None  # the engine, in words (InferenceEngine.describe)
    reference: bool = False  # computed by the fp32 reference (the model itself, full decode)

    def to_dict(self) -> dict[str, Any]:
        run = {"precision": self.precision, "engine": self.engine, "reference": self.reference}
        return {**self.metrics.to_dict(self.class_names), **run, "notes": self.notes}

    def precision_note(self) -> str:
        """How the figures were computed, for the line beside them: e.g. ``in bf16 (--precision fp32: the
        reference)``; empty when unknown."""
        if self.precision is None:
            return ""
        return f"in {self.precision}" + ("" if self.reference else " (--precision fp32 gives the reference)")


def dataset_file_names(dataset: Any) -> list[str] | None:
    """Per-example file names when the dataset records them (ImageFolder-like), else None."""
    for attr in ("files", "paths"):
        names = getattr(dataset, attr, None)
        if names is not None and len(names) == len(dataset):
            return [str(n) for n in names]
    samples = getattr(dataset, "samples", None)
    if samples is not None and len(samples) == len(dataset) and all(isinstance(s, tuple | list) for s in samples[:1]):
        return [str(s[0]) for s in samples]
    return None


def evaluate_dataset(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    dataset: Any,
    preprocess: Preprocess,
    *,
    class_names: Sequence[str] | None = None,
    label_file: str | os.PathLike[str] | None = None,
    batch_size: int = 64,
    device: torch.device | str | None = "cpu",
    workers: int = 0,
    progress: bool = True,
    precision: str = "fp32",
    backend: str = "torch",
    on_engine: Callable[[InferenceEngine], None] | None = None,
    dist: DistInfo | None = None,
    decode: str = "cpu",
) -> EvalReport:
    """Top-1/top-5, per-class accuracy and confusion matrix (plus ReaL accuracy given a label-set file).

    ``model``: a model, run on an :class:`~vitkit.inference.engine.InferenceEngine` in ``precision`` (default
    ``fp32``: the model itself, the reference numbers) on ``backend`` (``on_engine`` is called with the engine
    once built, after the inputs are checked), or an engine already built, or the spec of one
    (:func:`~vitkit.inference.jobs.engine_spec`). ``workers``: decoding processes
    (0: this one). ``dist``: the processes of a ``torchrun`` job, each running its share of the dataset; every
    process gets the report of the whole dataset, the one a single process computes. ``decode``: where JPEGs
    are decoded (``cpu``, ``gpu``, ``auto``: :func:`vitkit.inference.jobs.plan_decode`)."""
    spec = engine_spec(model, preprocess, precision=precision, backend=backend, device=device)
    K = spec.model.cfg.num_classes
    if K <= 0:
        raise ConfigError("the model has no classification head (num_classes=0); use 'vitkit fewshot' instead")
    mapping, notes = align_labels(list(dataset.classes), class_names, K)
    names = list(class_names) if class_names else list(dataset.classes)
    sets = None
    if label_file is not None:  # read before any compute when the dataset size is known
        if is_map_style(dataset):
            sets = read_label_sets(label_file, len(dataset), names, dataset_file_names(dataset))
        elif not Path(label_file).is_file():
            raise DataError(f"{label_file}: no such label file")
    out = extract(
        spec, dataset, preprocess, batch_size=batch_size, workers=workers, desc="eval", progress=progress,
        on_engine=on_engine, dist=dist, decode=decode,
    )  # fmt: skip
    assert out.logits is not None
    if out.decode_note:
        notes = [*notes, out.decode_note]
    labels = out.labels if mapping is None else mapping[out.labels]
    if labels.min() < 0 or labels.max() >= K:
        raise DataError(f"labels outside 0..{K - 1} in the dataset")
    label_sets = None
    if label_file is not None:
        if sets is None:
            sets = read_label_sets(label_file, len(out.labels), names)
        label_sets = [sets[i] for i in out.indices]
    engine = out.engine
    return EvalReport(
        compute_metrics(out.logits, labels, K, label_sets),
        names,
        notes,
        precision=engine.precision if engine else None,
        engine=engine.describe() if engine else None,
        reference=bool(engine and engine.plan.full_decode),
    )


REPORT_FILES = ("metrics.json", "per_class.csv", "confusion.csv", "confusion.png")


def check_eval_report_dir(out_dir: str | os.PathLike[str]) -> None:
    """Refuse a folder :func:`write_eval_report` would refuse (a file, a read-only place, a folder holding files
    of something else): ``vitkit eval`` asks this before evaluating, not after."""
    check_report_dir(Path(out_dir), REPORT_FILES.__contains__, ("metrics.json", "top1"), "vitkit eval report")


def write_eval_report(report: EvalReport, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """metrics.json, per_class.csv, confusion.csv and confusion.png in ``out_dir`` (a new or empty folder, or
    one holding only an earlier eval report: other files are never overwritten)."""
    from vitkit.analysis.plots import plot_confusion

    out = Path(out_dir)
    check_eval_report_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    m, names = report.metrics, report.class_names
    paths = {
        "metrics": out / "metrics.json",
        "per_class": out / "per_class.csv",
        "confusion_csv": out / "confusion.csv",
        "confusion_png": out / "confusion.png",
    }
    per_class: list[list[Any]] = [["class", "accuracy", "support"]]
    per_class += [
        [n, "" if np.isnan(a) else f"{a:.6f}", int(c)] for n, a, c in zip(names, m.per_class, m.support, strict=True)
    ]
    confusion: list[list[Any]] = [["true \\ predicted", *names]]
    confusion += [[name, *(int(v) for v in row)] for name, row in zip(names, m.confusion, strict=True)]
    write_text_atomic(paths["metrics"], json.dumps(report.to_dict(), indent=2) + "\n")
    write_text_atomic(paths["per_class"], _csv_text(per_class))
    write_text_atomic(paths["confusion_csv"], _csv_text(confusion))
    plot_confusion(m.confusion, names, paths["confusion_png"])
    return paths


def _csv_text(rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def dataset_labels(dataset: Any) -> np.ndarray | None:
    """All labels without decoding images, when the dataset exposes them (``labels`` / ``targets``)."""
    if not is_map_style(dataset):
        return None
    for attr in ("labels", "targets"):
        labels = getattr(dataset, attr, None)
        if labels is not None and len(labels) == len(dataset):
            return np.asarray(labels, dtype=np.int64)
    return None


def fewshot_dataset(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    train: Any,
    test: Any,
    preprocess: Preprocess,
    *,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2: float | str = DEFAULT_L2,
    heldout_per_class: int = 10,
    l2_grid: Sequence[float] = L2_GRID,
    batch_size: int = 64,
    device: torch.device | str | None = "cpu",
    workers: int = 0,
    progress: bool = True,
    precision: str = "fp32",
    on_engine: Callable[[InferenceEngine], None] | None = None,
) -> FewShotResult:
    """Few-shot linear evaluation of a frozen model: features of the training split's sampled shots and of
    the whole test split, then the closed-form probe of :mod:`vitkit.evaluate.fewshot`.

    When the training dataset exposes its labels, only the sampled examples are run through the model.
    ``model``: a model, run in ``precision`` (default ``fp32``: the model itself; ``on_engine`` is called with
    the engine once built, after the episodes are drawn), or an engine already built, or the spec of one
    (:func:`~vitkit.inference.jobs.engine_spec`).
    """
    K = len(train.classes)
    if len(test.classes) != K:
        raise DataError(f"the training split has {K} classes but the test split has {len(test.classes)}")
    held = heldout_per_class if l2 == "auto" else 0
    spec = engine_spec(model, preprocess, precision=precision, device=device)
    built: list[InferenceEngine] = []

    def engine() -> InferenceEngine:  # one engine for both splits (its weights packed once), built when needed
        if not built:
            built.append(spec.build(batch_size, None))
            if on_engine is not None and built[0] is not spec.built:
                on_engine(built[0])
        return built[0]

    kw: dict[str, Any] = {"batch_size": batch_size, "workers": workers, "progress": progress}
    labels = dataset_labels(train)
    if labels is not None:  # sample first, then extract only what the episodes use
        episodes = sample_episodes(labels, K, shots, seeds, held)
        needed = np.unique(np.concatenate([np.concatenate([e.train, e.heldout]) for e in episodes]))
        tr = extract(engine(), train, preprocess, logits=False, features=True, indices=needed.tolist(), **kw,
                     desc="features (train shots)")  # fmt: skip
        pos = np.full(len(labels), -1, dtype=np.int64)
        pos[tr.indices] = np.arange(len(tr.indices))
        episodes = [type(e)(e.seed, e.shots, pos[e.train], pos[e.heldout]) for e in episodes]
    else:
        tr = extract(engine(), train, preprocess, logits=False, features=True, desc="features (train)", **kw)
        episodes = sample_episodes(tr.labels, K, shots, seeds, held)
    te = extract(engine(), test, preprocess, logits=False, features=True, desc="features (test)", **kw)
    assert tr.features is not None and te.features is not None
    return run_episodes(episodes, tr.features, tr.labels, te.features, te.labels, K, l2, l2_grid)


def fewshot_embeddings(
    train: str | os.PathLike[str],
    test: str | os.PathLike[str],
    *,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2: float | str = DEFAULT_L2,
    heldout_per_class: int = 10,
    l2_grid: Sequence[float] = L2_GRID,
) -> FewShotResult:
    """:func:`fewshot_dataset` on cached features: two outputs of ``vitkit embed`` (the training split's and the
    test split's, of a labelled dataset) instead of a model's forward passes. The episodes are drawn from the
    training file's labels exactly as from the dataset's, so the same features give the same result."""
    from vitkit.evaluate.knn import comparable_embeddings

    tr, te = comparable_embeddings(train, test)
    if not (np.array_equal(tr.index, np.arange(len(tr))) and np.array_equal(te.index, np.arange(len(te)))):
        raise DataError(f"{train} or {test}: not a whole split in order (the episodes address examples by position)")
    K = int(max(tr.labels.max(), te.labels.max())) + 1
    held = heldout_per_class if l2 == "auto" else 0
    episodes = sample_episodes(tr.labels, K, shots, seeds, held)
    x_tr = np.asarray(tr.vectors, dtype=np.float32).reshape(len(tr), -1)
    x_te = np.asarray(te.vectors, dtype=np.float32).reshape(len(te), -1)
    return run_episodes(episodes, x_tr, tr.labels, x_te, te.labels, K, l2, l2_grid)
