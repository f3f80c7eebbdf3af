"""The approximate backend of ``vitkit index --backend hnsw``: an HNSW graph (Malkov & Yashunin, 2018) built by
hnswlib, the library chosen by measurement among faiss-cpu, hnswlib and usearch (BENCHMARKS.md, "Similarity
search"). It is the optional extra ``vitkit[search]``; without it, ``--backend hnsw`` is one line naming it.

The graph is over inner products of the index's L2-normalised vectors (= cosine similarity); its labels are the
rows of ``vectors.f32``. It is read only after the manifest's size and checksum of its file have passed
(:func:`vitkit.search.format.verify`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import ConfigError

NAME = "hnsw"
LIBRARY = "hnswlib"
M = 16  # links per node (level 0: 2M): memory per vector 4 * 2M + ~40 bytes beyond the float32 vector
EF_CONSTRUCTION = 100
EF_SEARCH = 128  # BENCHMARKS.md: recall@10 0.998 on 200k clustered 384-d vectors (64: 0.981)


def library() -> Any:
    """The hnswlib module, or one line saying how to install it."""
    try:
        import hnswlib
    except ImportError:
        raise ConfigError(
            "the approximate backend needs hnswlib: pip install 'vitkit[search]' (or use --exact)"
        ) from None
    return hnswlib


def params(ef_search: int = EF_SEARCH) -> dict[str, Any]:
    """The backend entry of a new index's manifest: library, version and graph parameters."""
    from importlib.metadata import version

    library()
    return {"name": NAME, "library": LIBRARY, "version": version(LIBRARY), "M": M,
            "ef_construction": EF_CONSTRUCTION, "ef_search": ef_search}  # fmt: skip


def _threads() -> int:
    from vitkit.hardware import cpu_count

    return max(1, cpu_count())


class Graph:
    """An hnswlib index over the rows of a vector matrix."""

    def __init__(self, index: Any, ef_search: int) -> None:
        self.index = index
        self.ef_search = ef_search
        index.set_ef(ef_search)

    @classmethod
    def build(cls, vectors: np.ndarray, backend: dict[str, Any]) -> Graph:
        """A graph over the rows of ``vectors`` (N, D), built with the manifest entry ``backend``'s parameters."""
        lib = library()
        index = lib.Index(space="ip", dim=vectors.shape[1])
        index.init_index(max_elements=max(1, len(vectors)), ef_construction=int(backend["ef_construction"]),
                         M=int(backend["M"]), random_seed=0)  # fmt: skip
        index.set_num_threads(_threads())
        if len(vectors):
            index.add_items(vectors, np.arange(len(vectors), dtype=np.int64))
        return cls(index, int(backend["ef_search"]))

    @classmethod
    def load(cls, path: Path, dimension: int, count: int, backend: dict[str, Any]) -> Graph:
        """The graph file of a verified index (its size and checksum already checked)."""
        lib = library()
        index = lib.Index(space="ip", dim=dimension)
        index.load_index(str(path), max_elements=max(1, count))
        if index.get_current_count() != count:
            from vitkit.search.format import IndexFileError

            raise IndexFileError(f"{path.parent}: its graph holds {index.get_current_count()} vectors, not {count}")
        index.set_num_threads(_threads())
        return cls(index, int(backend["ef_search"]))

    def add(self, vectors: np.ndarray, start: int) -> None:
        """Append ``vectors`` as rows ``start``, ``start + 1``, ... (the graph grows in place)."""
        if not len(vectors):
            return
        self.index.resize_index(start + len(vectors))
        self.index.add_items(vectors, np.arange(start, start + len(vectors), dtype=np.int64))

    def save(self, path: Path) -> None:
        """Write the graph to ``path`` (a file in the folder being written)."""
        self.index.save_index(str(path))

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Rows (M, k) of the approximate top ``k`` per query (k at most the number of vectors)."""
        self.index.set_ef(max(self.ef_search, k))
        labels, _ = self.index.knn_query(np.ascontiguousarray(queries, dtype=np.float32), k=k)
        return np.asarray(labels, dtype=np.int64)
