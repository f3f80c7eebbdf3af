"""Evaluation: accuracy metrics, batched feature extraction, the paper's few-shot linear probe."""

from vitkit.evaluate.evaluate import EvalReport, evaluate_dataset, fewshot_dataset, write_eval_report
from vitkit.evaluate.fewshot import FewShotResult, RidgeProbe, fewshot_evaluate, sample_episodes
from vitkit.evaluate.metrics import Metrics, compute_metrics, confusion_matrix, read_label_sets, topk_correct
from vitkit.inference.features import Extracted, extract

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
