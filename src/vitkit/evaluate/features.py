"""Batched forward passes over a dataset: moved to :mod:`vitkit.inference.features` (training's feature cache
uses them too, and training must not import evaluation, which imports training). The names stay importable here."""

from vitkit.inference.features import Extracted, extract, is_map_style

__all__ = ["Extracted", "extract", "is_map_style"]
