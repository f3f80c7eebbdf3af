"""The evaluation behind ``vitkit eval``, callable from Python: top-1/top-5, per class, confusion matrix, ReaL.

Like the other evaluators (``fewshot_dataset`` in :mod:`vitkit.evaluate.fewshot`, ``knn_dataset`` in
:mod:`vitkit.evaluate.knn`) it takes a model (or an engine, or its spec), its
:class:`~vitkit.checkpoints.preprocess.Preprocess` (from the checkpoint), a dataset that follows vitkit's data
interface (``classes``, ``__len__``, ``__getitem__ -> (PIL image, label)``, or iterable-only for streams) and
one :class:`~vitkit.inference.features.ExtractOptions`, and reads the dataset through a
:class:`~vitkit.inference.features.FeatureProvider`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, DataError
from vitkit.evaluate.metrics import Metrics, compute_metrics, read_label_sets
from vitkit.fileio import write_text_atomic
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import EXTRACT_DEFAULTS, ExtractOptions, FeatureProvider, is_map_style
from vitkit.inference.jobs import EngineSpec
from vitkit.models.vit import VisionTransformer
from vitkit.output_paths import check_report_dir
from vitkit.outputs.rows import csv_text


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
    opts: ExtractOptions = EXTRACT_DEFAULTS,
) -> EvalReport:
    """Top-1/top-5, per-class accuracy and confusion matrix (plus ReaL accuracy given a label-set file).

    ``model``: a model, run on an :class:`~vitkit.inference.engine.InferenceEngine` in ``opts.precision``
    (default ``fp32``: the model itself, the reference numbers) on ``opts.backend`` (``opts.on_engine`` is called
    with the engine once built, after the inputs are checked), or an engine already built, or the spec of one
    (:func:`~vitkit.inference.jobs.engine_spec`). Under ``torchrun`` (``opts.dist``) each process runs its share
    of the dataset and every process gets the report of the whole dataset, the one a single process computes.
    Images that do not decode with ``opts.skip_bad`` are left out, said in the report's notes."""
    features = FeatureProvider(model, preprocess, opts)
    K = features.model.cfg.num_classes
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
    out = features.extract(dataset, desc="eval")
    assert out.logits is not None
    notes = [*notes, *out.notes, *([out.decode_note] if out.decode_note else [])]
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
        key: out / name
        for key, name in zip(("metrics", "per_class", "confusion_csv", "confusion_png"), REPORT_FILES, strict=True)
    }
    per_class: list[list[Any]] = [["class", "accuracy", "support"]]
    per_class += [
        [n, "" if np.isnan(a) else f"{a:.6f}", int(c)] for n, a, c in zip(names, m.per_class, m.support, strict=True)
    ]
    confusion: list[list[Any]] = [["true \\ predicted", *names]]
    confusion += [[name, *(int(v) for v in row)] for name, row in zip(names, m.confusion, strict=True)]
    write_text_atomic(paths["metrics"], json.dumps(report.to_dict(), indent=2) + "\n")
    write_text_atomic(paths["per_class"], csv_text(per_class, "\r\n"))  # \r\n: csv's own default, as ever
    write_text_atomic(paths["confusion_csv"], csv_text(confusion, "\r\n"))
    plot_confusion(m.confusion, names, paths["confusion_png"])
    return paths
