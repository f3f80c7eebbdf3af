"""Weighted k-nearest-neighbour classification on frozen features: the DINO protocol (Caron et al., 2021,
``eval_knn.py``), behind ``vitkit knn``.

- train ("bank") and test features are L2-normalised; similarity is their dot product (cosine similarity);
- each test feature's ``k`` most similar bank features (default 20) vote for their labels with weight
  ``exp(similarity / T)`` (T = 0.07); the votes of a class are summed;
- the prediction is the class with the most votes (ties: the lowest class index), top-5 the five with the most.

The similarities are computed in blocks of ``query_chunk`` test features against ``bank_chunk`` bank features,
keeping a running top-k per query, so the memory of a search is ``query_chunk x bank_chunk`` similarities plus
``query_chunk x 2k`` candidates, whatever the size of the bank (a million-vector bank is searched in blocks).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, DataError
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import EXTRACT_DEFAULTS, ExtractOptions, FeatureProvider
from vitkit.inference.jobs import EngineSpec
from vitkit.inference.provenance import check_comparable
from vitkit.models.vit import MAX_CLASSES, VisionTransformer
from vitkit.outputs.array_reader import Embeddings, read_embeddings
from vitkit.search.exact import exact_search

DEFAULT_K = 20
DEFAULT_TEMPERATURE = 0.07


@dataclass
class KnnResult:
    """Per test example the classes by votes (``ranked``, (M, min(5, K)), most votes first) and the summed
    votes (M, K); ``largest_block``: the most similarities held at once (query rows x bank columns)."""

    ranked: np.ndarray
    votes: np.ndarray
    largest_block: int

    @property
    def predictions(self) -> np.ndarray:
        return self.ranked[:, 0]


@dataclass
class KnnReport:
    """Top-1 and top-5 accuracy of a kNN classification, with its k, temperature and sizes."""

    top1: float
    top5: float
    k: int
    temperature: float
    num_train: int
    num_test: int
    notes: list[str] = field(default_factory=list)  # e.g. images left out that did not decode (skip_bad)

    def to_dict(self) -> dict[str, Any]:
        """The figures (the notes go to stderr, as those of ``knn_embeddings`` do)."""
        return {k: v for k, v in self.__dict__.items() if k != "notes"}


def normalize(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(N, D) -> the rows divided by their L2 norms, float32 (rows of zeros stay zero)."""
    t = x.float() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, dtype=np.float32))
    return torch.nn.functional.normalize(t, dim=1)


def knn_classify(
    train_x: np.ndarray | torch.Tensor,
    train_y: np.ndarray,
    test_x: np.ndarray | torch.Tensor,
    num_classes: int,
    *,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    query_chunk: int = 256,
    bank_chunk: int = 65536,
) -> KnnResult:
    """The DINO kNN classifier (module docstring) of ``test_x`` (M, D) against the bank ``train_x`` (N, D)
    labelled ``train_y`` (N,) in 0..num_classes-1, in blocks of ``query_chunk`` x ``bank_chunk``."""
    if k < 1 or temperature <= 0 or query_chunk < 1 or bank_chunk < 1:
        raise ConfigError(f"k ({k}), the temperature ({temperature}) and the chunk sizes must be positive")
    bank = normalize(train_x)  # (N, D)
    queries = normalize(test_x)  # (M, D)
    labels = torch.as_tensor(np.asarray(train_y, dtype=np.int64))  # (N,)
    if bank.ndim != 2 or queries.ndim != 2 or bank.shape[1] != queries.shape[1] or len(labels) != len(bank):
        raise DataError(
            f"features do not match: train {tuple(bank.shape)} with {len(labels)} labels, test {tuple(queries.shape)}"
        )
    if len(bank) == 0:
        raise DataError("the train bank has no features")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(f"train labels outside 0..{num_classes - 1}")
    # the k most similar bank features of every query, in blocks (exact_search: ties to the earlier bank entry)
    scores, rows = exact_search(bank.numpy(), queries.numpy(), k, query_block=query_chunk, bank_block=bank_chunk)
    weights = (torch.from_numpy(scores) / temperature).exp()  # (M, k)
    votes = torch.zeros(len(queries), num_classes, dtype=torch.float64)
    votes.scatter_add_(1, labels[torch.from_numpy(rows)], weights.double())  # (M, K): summed votes per class
    ranked = (-votes).argsort(dim=1, stable=True)[:, : min(5, num_classes)]  # ties: the lower class first
    largest = min(query_chunk, len(queries)) * min(bank_chunk, len(bank))  # exact_search's first block, its largest
    return KnnResult(ranked.numpy(), votes.numpy(), largest)


def knn_evaluate(
    train_x: np.ndarray | torch.Tensor,
    train_y: np.ndarray,
    test_x: np.ndarray | torch.Tensor,
    test_y: np.ndarray,
    num_classes: int,
    *,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    query_chunk: int = 256,
    bank_chunk: int = 65536,
) -> KnnReport:
    """Top-1/top-5 accuracy of :func:`knn_classify` on labelled test features."""
    test_y = np.asarray(test_y, dtype=np.int64)
    if len(test_y) != len(test_x) or len(test_y) == 0:
        raise DataError(f"{len(test_x)} test features but {len(test_y)} labels")
    res = knn_classify(train_x, train_y, test_x, num_classes, k=k, temperature=temperature,
                       query_chunk=query_chunk, bank_chunk=bank_chunk)  # fmt: skip
    top1 = float((res.ranked[:, 0] == test_y).mean())
    top5 = float((res.ranked == test_y[:, None]).any(axis=1).mean())
    return KnnReport(top1, top5, min(k, len(train_y)), temperature, len(train_y), len(test_y))


def knn_dataset(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    train: Any,
    test: Any,
    preprocess: Preprocess,
    *,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    query_chunk: int = 256,
    bank_chunk: int = 65536,
    opts: ExtractOptions = EXTRACT_DEFAULTS,
) -> KnnReport:
    """kNN accuracy of a frozen model: pre-logits features of the whole training split (the bank) and of the
    test split, through one :class:`~vitkit.inference.features.FeatureProvider` (one engine for both), then
    :func:`knn_evaluate`. ``model``: a model, run in ``opts.precision`` (default ``fp32``: the model itself), or an
    engine already built, or the spec of one (:func:`~vitkit.inference.jobs.engine_spec`). ``opts.dist``: the
    processes of a ``torchrun`` job, each extracting its share of both splits (the report is the one process
    computes, on every process). Images that do not decode with ``opts.skip_bad`` are left out, said in ``notes``."""
    K = len(train.classes)
    if len(test.classes) != K:
        raise DataError(f"the training split has {K} classes but the test split has {len(test.classes)}")
    features = FeatureProvider(model, preprocess, opts)
    tr = features.extract(train, logits=False, features=True, desc="features (train)")
    te = features.extract(test, logits=False, features=True, desc="features (test)")
    assert tr.features is not None and te.features is not None
    report = knn_evaluate(tr.features, tr.labels, te.features, te.labels, K, k=k, temperature=temperature,
                          query_chunk=query_chunk, bank_chunk=bank_chunk)  # fmt: skip
    report.notes = [*tr.notes, *te.notes]
    return report


def knn_embeddings(
    train: str | os.PathLike[str],
    test: str | os.PathLike[str],
    *,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    query_chunk: int = 256,
    bank_chunk: int = 65536,
    notes: list[str] | None = None,
) -> KnnReport:
    """kNN accuracy from two outputs of ``vitkit embed`` (the training split's, the bank, and the test split's;
    made from a labelled dataset): :func:`knn_evaluate` of their vectors (flattened) and labels. The rows of
    images that failed (embedded with ``--skip-bad``) are left out, as the dataset path leaves those images out,
    and counted: one line per file in ``notes``."""
    tr, te, K = comparable_embeddings(train, test, drop_failed=True, notes=notes)
    return knn_evaluate(tr.vectors.reshape(len(tr), -1), tr.labels, te.vectors.reshape(len(te), -1), te.labels, K,
                        k=k, temperature=temperature, query_chunk=query_chunk, bank_chunk=bank_chunk)  # fmt: skip


def labelled_embeddings(
    path: str | os.PathLike[str], option: str, *, drop_failed: bool = False, notes: list[str] | None = None
) -> Embeddings:
    """An output of ``vitkit embed`` whose every row has a label and a vector (DataError naming ``option`` and
    the file otherwise). ``drop_failed``: the rows of images that failed (``--skip-bad``) are left out instead,
    and said in ``notes``."""
    e = read_embeddings(path)
    if e.errors and drop_failed:
        failed, e = e.errors, _without_failed(e)
        if notes is not None:
            first = min(failed)
            notes.append(f"{option} {path}: left out {len(failed)} row(s) of images that failed (embedded with "
                         f"--skip-bad; first: row {first}: {failed[first]})")  # fmt: skip
    if len(e) == 0:
        raise DataError(f"{option} {path}: holds no embeddings")
    if (e.labels < 0).any():
        raise DataError(f"{option} {path}: has rows without a label; embed a labelled dataset (--data)")
    if e.errors:
        raise DataError(f"{option} {path}: {len(e.errors)} row(s) of images that failed (embedded with --skip-bad)")
    if int(e.labels.max()) >= MAX_CLASSES:  # K = the largest label + 1 sizes the votes and the probe's head
        raise DataError(f"{option} {path}: label {int(e.labels.max())} is above {MAX_CLASSES - 1}, the most classes "
                        "vitkit takes")  # fmt: skip
    return e


def _without_failed(e: Embeddings) -> Embeddings:
    """``e`` without the rows of images that failed (their vectors are not read)."""
    keep = np.setdiff1d(np.arange(len(e)), np.fromiter(e.errors, dtype=np.int64, count=len(e.errors)))
    return dataclasses.replace(
        e, ids=[e.ids[i] for i in keep], index=e.index[keep], labels=e.labels[keep], vectors=e.vectors[keep], errors={}
    )


def comparable_embeddings(
    train: str | os.PathLike[str],
    test: str | os.PathLike[str],
    *,
    drop_failed: bool = False,
    notes: list[str] | None = None,
) -> tuple[Embeddings, Embeddings, int]:
    """The train and test embeddings (:func:`labelled_embeddings`), made by one checkpoint, precision,
    preprocessing and pooling (:func:`~vitkit.inference.provenance.check_comparable`), and the classes they
    cover (the largest label + 1)."""
    tr = labelled_embeddings(train, "--train-embeddings", drop_failed=drop_failed, notes=notes)
    te = labelled_embeddings(test, "--test-embeddings", drop_failed=drop_failed, notes=notes)
    check_comparable(tr.meta, te.meta, f"--train-embeddings {train}", f"--test-embeddings {test}")
    return tr, te, int(max(tr.labels.max(), te.labels.max())) + 1
