"""Classification metrics on logits and labels: top-k, per-class accuracy, confusion matrix, ReaL.

Everything works on numpy arrays so it can be checked against scikit-learn and reused on any logits.

ReaL-style evaluation (Beyer et al., "Are we done with ImageNet?", 2020) replaces the single label of each
example by a *set* of acceptable labels, possibly empty; an example counts as correct when the top-1
prediction is in its set, and examples with an empty set are left out. :func:`read_label_sets` reads such
sets from a file (format in its docstring).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vitkit.errors import DataError


def topk_correct(logits: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Boolean (B,): whether the true label is among the k highest logits of each row.

    Ties are broken by the lower class index, as ``torch.topk`` and ``numpy.argsort(kind="stable")`` do.
    """
    logits, labels = np.asarray(logits), np.asarray(labels)
    k = min(k, logits.shape[1])
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # (B, k)
    return (order == labels[:, None]).any(axis=1)


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """(K, K) counts; row = true class, column = predicted class (scikit-learn's convention)."""
    labels, preds = np.asarray(labels, dtype=np.int64), np.asarray(preds, dtype=np.int64)
    flat = labels * num_classes + preds
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def per_class_accuracy(confusion: np.ndarray) -> np.ndarray:
    """Recall of every class from a confusion matrix; NaN for classes with no examples."""
    support = confusion.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(support > 0, np.diag(confusion) / np.maximum(support, 1), np.nan)


def real_accuracy(preds: np.ndarray, label_sets: Sequence[Sequence[int]]) -> tuple[float, int]:
    """ReaL accuracy: fraction of examples with a non-empty label set whose prediction is in the set.

    Returns (accuracy, number of examples counted). Accuracy is NaN when every set is empty.
    """
    if len(preds) != len(label_sets):
        raise DataError(f"{len(label_sets)} label sets for {len(preds)} predictions")
    hits = [int(p) in set(s) for p, s in zip(preds, label_sets, strict=True) if len(s) > 0]
    return (float(np.mean(hits)) if hits else float("nan")), len(hits)


@dataclass
class Metrics:
    """Everything ``vitkit eval`` reports."""

    num_examples: int
    top1: float
    top5: float
    k: int  # the "5" of top-5 (smaller for fewer than 5 classes)
    per_class: np.ndarray  # (K,) accuracy of each class (NaN: no examples)
    support: np.ndarray  # (K,) examples of each class
    confusion: np.ndarray  # (K, K)
    real: float | None = None
    real_count: int | None = None

    def to_dict(self, class_names: Sequence[str] | None = None) -> dict[str, object]:
        names = list(class_names) if class_names else [str(i) for i in range(len(self.per_class))]
        d: dict[str, object] = {
            "num_examples": self.num_examples,
            "top1": self.top1,
            f"top{self.k}": self.top5,
            "per_class": {
                n: {"accuracy": None if np.isnan(a) else float(a), "support": int(s)}
                for n, a, s in zip(names, self.per_class, self.support, strict=True)
            },
        }
        if self.real is not None:
            d["real_top1"] = None if np.isnan(self.real) else self.real
            d["real_count"] = self.real_count
        return d


def compute_metrics(
    logits: np.ndarray,
    labels: np.ndarray,
    num_classes: int | None = None,
    label_sets: Sequence[Sequence[int]] | None = None,
    top_k: int = 5,
) -> Metrics:
    """All metrics from logits (B, K) and integer labels (B,), optionally with ReaL label sets."""
    logits, labels = np.asarray(logits), np.asarray(labels, dtype=np.int64)
    K = num_classes or logits.shape[1]
    if len(labels) == 0:
        raise DataError("no examples to evaluate")
    preds = logits.argmax(axis=1)
    conf = confusion_matrix(labels, preds, K)
    k = min(top_k, K)
    real, count = real_accuracy(preds, label_sets) if label_sets is not None else (None, None)
    return Metrics(
        num_examples=len(labels),
        top1=float(topk_correct(logits, labels, 1).mean()),
        top5=float(topk_correct(logits, labels, k).mean()),
        k=k,
        per_class=per_class_accuracy(conf),
        support=conf.sum(axis=1),
        confusion=conf,
        real=real,
        real_count=count,
    )


# ---- ReaL label files ---------------------------------------------------------------------------------

LABEL_FILE_HELP = """\
Label-set file for ReaL-style evaluation: one set of acceptable labels per example; an example is correct
when the top-1 prediction is in its set, and examples with an empty set are left out. Formats:
JSON list, one entry per example in dataset order: [[3], [], [1, 7], ...] (the official ImageNet
ReaL 'real.json' is exactly this); JSON object keyed by example index or file name:
{"0": [3], "img_001.png": [1, 7]}; or CSV with a header 'key,labels', labels separated by spaces
(empty: no acceptable label). Labels are class indices or class names. Examples absent from an object
or CSV are left out."""


def read_label_sets(
    path: str | os.PathLike[str],
    num_examples: int,
    class_names: Sequence[str] | None = None,
    file_names: Sequence[str] | None = None,
) -> list[list[int]]:
    """Read a ReaL-style label-set file into one list of class indices per example (format above).

    ``file_names`` (one per example, when the dataset knows them) lets keys be file names as well as
    indices; a key matches the full stored name or its base name.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such label file")
    raw = _parse_label_file(p)
    if isinstance(raw, list):
        if len(raw) != num_examples:
            raise DataError(f"{p}: {len(raw)} label sets for a dataset of {num_examples} examples")
        entries: Mapping[int, object] = dict(enumerate(raw))
    else:
        entries = _keys_to_indices(p, raw, num_examples, file_names)
    lookup = {name: i for i, name in enumerate(class_names or [])}
    K = len(class_names) if class_names else None
    sets: list[list[int]] = [[] for _ in range(num_examples)]
    for i, labels in entries.items():
        if not isinstance(labels, list):
            raise DataError(f"{p}: the labels of example {i} are not a list")
        sets[i] = [_label_index(p, lab, lookup, K) for lab in labels]
    return sets


def _parse_label_file(p: Path) -> list[object] | dict[str, object]:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not a UTF-8 text label file ({e.reason} at byte {e.start})") from None
    if p.suffix.lower() == ".csv":
        rows = list(csv.reader(text.splitlines()))
        if not rows or [c.strip().lower() for c in rows[0][:2]] != ["key", "labels"]:
            raise DataError(f"{p}: a CSV label file needs the header 'key,labels'")
        out: dict[str, object] = {}
        for n, row in enumerate(rows[1:], start=2):
            if not row:
                continue
            if len(row) > 2:
                raise DataError(f"{p}: line {n}: expected 'key,labels' (labels separated by spaces)")
            labels = row[1].split() if len(row) > 1 else []
            out[row[0].strip()] = [int(t) if t.lstrip("-").isdigit() else t for t in labels]
        return out
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DataError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(doc, list | dict):
        raise DataError(f"{p}: expected a JSON list or object of label lists")
    return doc


def _keys_to_indices(p: Path, raw: dict[str, object], n: int, file_names: Sequence[str] | None) -> dict[int, object]:
    by_name: dict[str, int] = {}
    for i, name in enumerate(file_names or []):
        by_name.setdefault(name, i)
        by_name.setdefault(os.path.basename(name), i)
    out: dict[int, object] = {}
    for key, labels in raw.items():
        if key in by_name:
            idx = by_name[key]
        elif key.isdigit():
            idx = int(key)
            if idx >= n:
                raise DataError(f"{p}: example index {idx} out of range (the dataset has {n} examples)")
        else:
            hint = "" if file_names else " (this dataset has no file names: use example indices)"
            raise DataError(f"{p}: key {key!r} is neither an example index nor a file name of the dataset{hint}")
        out[idx] = labels
    return out


def _label_index(p: Path, label: object, lookup: Mapping[str, int], K: int | None) -> int:
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise DataError(f"{p}: label {label!r} is neither a class index nor a class name")
    if isinstance(label, str):
        if label not in lookup:
            raise DataError(f"{p}: unknown class name {label!r}")
        return lookup[label]
    if label < 0 or (K is not None and label >= K):
        raise DataError(f"{p}: class index {label} out of range" + (f" (0..{K - 1})" if K else ""))
    return label
