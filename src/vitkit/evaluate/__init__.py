"""Evaluation: accuracy metrics, batched feature extraction, the paper's few-shot linear probe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitkit.lazy import lazy_attributes

if TYPE_CHECKING:
    from vitkit.evaluate.evaluate import EvalReport, evaluate_dataset, fewshot_dataset, write_eval_report
    from vitkit.evaluate.fewshot import FewShotResult, RidgeProbe, fewshot_evaluate, sample_episodes
    from vitkit.evaluate.metrics import Metrics, compute_metrics, confusion_matrix, read_label_sets, topk_correct
    from vitkit.inference.features import Extracted, extract

# imported on first use (PEP 562): ``vitkit eval --help`` reads metrics' label-file help, without the model code
_LAZY = {
    "EvalReport": "vitkit.evaluate.evaluate",
    "evaluate_dataset": "vitkit.evaluate.evaluate",
    "fewshot_dataset": "vitkit.evaluate.evaluate",
    "write_eval_report": "vitkit.evaluate.evaluate",
    "FewShotResult": "vitkit.evaluate.fewshot",
    "RidgeProbe": "vitkit.evaluate.fewshot",
    "fewshot_evaluate": "vitkit.evaluate.fewshot",
    "sample_episodes": "vitkit.evaluate.fewshot",
    "Metrics": "vitkit.evaluate.metrics",
    "compute_metrics": "vitkit.evaluate.metrics",
    "confusion_matrix": "vitkit.evaluate.metrics",
    "read_label_sets": "vitkit.evaluate.metrics",
    "topk_correct": "vitkit.evaluate.metrics",
    "Extracted": "vitkit.inference.features",
    "extract": "vitkit.inference.features",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "EvalReport",
    "Extracted",
    "FewShotResult",
    "Metrics",
    "RidgeProbe",
    "compute_metrics",
    "confusion_matrix",
    "evaluate_dataset",
    "extract",
    "fewshot_dataset",
    "fewshot_evaluate",
    "read_label_sets",
    "sample_episodes",
    "topk_correct",
    "write_eval_report",
]
