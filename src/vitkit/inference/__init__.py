"""Inference: the fast path (``optimize_for_inference``, a model transform that keeps the function) and
prediction over image files (``predict``)."""

from vitkit.inference.fast import optimize_for_inference
from vitkit.inference.predict import Prediction, predict

__all__ = ["Prediction", "optimize_for_inference", "predict"]
