"""Evaluation: accuracy metrics (``eval``), the paper's few-shot linear probe (``fewshot``), weighted k-nearest
neighbours (``knn``, the DINO protocol), over one features provider.

Every evaluator takes a model (or an engine, or its spec), its preprocessing, its datasets and one
:class:`~vitkit.inference.features.ExtractOptions`; each reads its splits through a
:class:`~vitkit.inference.features.FeatureProvider` (one engine, built through the job runner). The drivers sit
beside their protocol: :mod:`~vitkit.evaluate.evaluate` (eval), :mod:`~vitkit.evaluate.fewshot`,
:mod:`~vitkit.evaluate.knn`; :mod:`~vitkit.evaluate.weights` picks a run's EMA or raw weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitkit.lazy import lazy_attributes

if TYPE_CHECKING:
    from vitkit.evaluate.evaluate import EvalReport, evaluate_dataset, write_eval_report
    from vitkit.evaluate.fewshot import (
        FewShotResult,
        RidgeProbe,
        fewshot_dataset,
        fewshot_embeddings,
        fewshot_evaluate,
        sample_episodes,
    )
    from vitkit.evaluate.knn import KnnReport, knn_dataset, knn_embeddings, knn_evaluate
    from vitkit.evaluate.metrics import Metrics, compute_metrics, confusion_matrix, read_label_sets, topk_correct
    from vitkit.inference.features import Extracted, ExtractOptions, FeatureProvider, extract

# imported on first use (PEP 562): ``vitkit eval --help`` reads metrics' label-file help, without the model code
_LAZY = {
    "EvalReport": "vitkit.evaluate.evaluate",
    "evaluate_dataset": "vitkit.evaluate.evaluate",
    "write_eval_report": "vitkit.evaluate.evaluate",
    "FewShotResult": "vitkit.evaluate.fewshot",
    "RidgeProbe": "vitkit.evaluate.fewshot",
    "fewshot_dataset": "vitkit.evaluate.fewshot",
    "fewshot_embeddings": "vitkit.evaluate.fewshot",
    "fewshot_evaluate": "vitkit.evaluate.fewshot",
    "KnnReport": "vitkit.evaluate.knn",
    "knn_dataset": "vitkit.evaluate.knn",
    "knn_embeddings": "vitkit.evaluate.knn",
    "knn_evaluate": "vitkit.evaluate.knn",
    "sample_episodes": "vitkit.evaluate.fewshot",
    "Metrics": "vitkit.evaluate.metrics",
    "compute_metrics": "vitkit.evaluate.metrics",
    "confusion_matrix": "vitkit.evaluate.metrics",
    "read_label_sets": "vitkit.evaluate.metrics",
    "topk_correct": "vitkit.evaluate.metrics",
    "Extracted": "vitkit.inference.features",
    "ExtractOptions": "vitkit.inference.features",
    "FeatureProvider": "vitkit.inference.features",
    "extract": "vitkit.inference.features",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "EvalReport",
    "ExtractOptions",
    "Extracted",
    "FeatureProvider",
    "FewShotResult",
    "KnnReport",
    "Metrics",
    "RidgeProbe",
    "compute_metrics",
    "confusion_matrix",
    "evaluate_dataset",
    "extract",
    "fewshot_dataset",
    "fewshot_embeddings",
    "fewshot_evaluate",
    "knn_dataset",
    "knn_embeddings",
    "knn_evaluate",
    "read_label_sets",
    "sample_episodes",
    "topk_correct",
    "write_eval_report",
]
