"""Similarity search over image embeddings: :class:`~vitkit.search.index.Index` (exact or HNSW), vitkit's index
format (:mod:`vitkit.search.format`), near-duplicate groups (:mod:`vitkit.search.dedup`) and the jobs behind
``vitkit index``, ``vitkit search`` and ``vitkit dedup`` (:mod:`vitkit.search.operations`). A layer beside evaluate and
inference: it reads embedding outputs and runs the embed job, and nothing below it imports it."""

from vitkit.search.format import IndexFileError
from vitkit.search.index import Hit, Index

__all__ = ["Hit", "Index", "IndexFileError"]
