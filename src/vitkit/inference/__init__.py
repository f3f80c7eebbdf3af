"""Inference: the fast path (``optimize_for_inference``, a model transform that keeps the function), the one
engine every job runs its images through (``InferenceEngine``: precision, backend, logits or features) and
prediction over images (``predict``)."""

from vitkit.inference.engine import InferenceEngine
from vitkit.inference.fast import optimize_for_inference
from vitkit.inference.predict import Prediction, predict

__all__ = ["InferenceEngine", "Prediction", "optimize_for_inference", "predict"]
