"""``vitkit.Index``: image embeddings with their ids and provenance, searched exactly, through k-means lists (IVF)
or through an HNSW graph, saved in vitkit's index format (:mod:`vitkit.search.format`).

Every vector is L2-normalised when it enters, so scores are cosine similarities. Exact search
(:func:`vitkit.search.exact.exact_search`) is the ground truth; an approximate backend (:mod:`vitkit.search.ann`)
proposes candidates from its lists or graph and their scores are then computed exactly from the stored vectors, so all
backends report the same score for the same pair.

Two sets of vectors can share an index (``add``) and a query can be searched in one only when they were made by the
same checkpoint (its weights' digest), preprocessing, pooling, layer and vector shape (:data:`COMPARED`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import ConfigError, DataError
from vitkit.fileio import clean_stale, complete_dir, write_dir_atomic
from vitkit.outputs.array_reader import Embeddings, read_embeddings
from vitkit.outputs.store import CHECKPOINT, PREPROCESS, check_same
from vitkit.search import ann
from vitkit.search import format as fmt
from vitkit.search.exact import exact_search, normalise
from vitkit.textids import text_id

# what decides whether two vectors are comparable (precision and storage dtype only round them; l2 does not
# matter for cosine similarity)
COMPARED = (CHECKPOINT, PREPROCESS, "vitkit.embed.pool", "vitkit.embed.layer", "vitkit.embed.shape")
# what an index records of its vectors' making (whatever of these the source carried)
RECORDED = (*COMPARED, "vitkit.precision", "vitkit.backend", "vitkit.embed.dtype", "vitkit.embed.l2")
BACKENDS = ("exact", "hnsw", "ivf")


@dataclass
class Hit:
    """One neighbour: its ``id`` and cosine ``score``."""

    id: str
    score: float


def _backend_doc(backend: str, count: int) -> dict[str, Any]:
    if backend == "exact":
        return {"name": "exact"}
    if backend in ("hnsw", "ivf"):
        return ann.params() if backend == "hnsw" else ann.ivf_params(count)
    raise ConfigError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def provenance_of(meta: Mapping[str, str]) -> dict[str, str]:
    """The keys of :data:`RECORDED` found in an embedding output's options."""
    return {k: str(meta[k]) for k in RECORDED if k in meta}


class Index:
    """A searchable set of image embeddings (module docstring). Build one with :meth:`build` or
    :meth:`from_embeddings`, read one with :meth:`open`, write it with :meth:`save`."""

    def __init__(self, ids: list[str], vectors: np.ndarray, provenance: Mapping[str, str], backend: Mapping[str, Any],
                 graph: Any = None) -> None:  # fmt: skip
        self.ids = ids
        self.vectors = vectors
        self.provenance = dict(provenance)
        self.backend = dict(backend)
        self._graph = graph
        self._rows: dict[str, int] | None = None

    # ---- making ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        ids: Sequence[str],
        vectors: np.ndarray,
        provenance: Mapping[str, str] | None = None,
        *,
        backend: str = "exact",
    ) -> Index:
        """An index of ``vectors`` (N, D) under ``ids`` (N distinct strings); ``provenance``: what they were made
        from (``vitkit.*`` keys, as :func:`vitkit.embed` / ``vitkit embed`` record them)."""
        doc = _backend_doc(backend, len(ids))
        ids = [text_id(str(i)) for i in ids]
        v = np.asarray(vectors)
        if v.ndim != 2 or len(v) != len(ids) or v.shape[1] < 1:
            raise DataError(f"an index takes one vector per id: got vectors of shape {v.shape} for {len(ids)} ids "
                            "(embed without --pool tokens)")  # fmt: skip
        if len(set(ids)) != len(ids):
            raise DataError("the ids repeat; an index holds each id once")
        v = _finite_normalised(v)
        graph = None
        if doc["name"] != "exact":
            graph = ann.structure(doc["name"]).build(v, doc)
        return cls(ids, v, dict(provenance or {}), doc, graph)

    @classmethod
    def from_embeddings(cls, source: str | os.PathLike[str] | Embeddings, *, backend: str = "exact",
                        notes: list[str] | None = None) -> Index:  # fmt: skip
        """An index of an output of ``vitkit embed`` (a path) or of :func:`vitkit.embed`'s result; rows of images
        that failed (``--skip-bad``) are left out (counted in ``notes``)."""
        e = read_embeddings(source) if not isinstance(source, Embeddings) else source
        ids, vectors = _usable(e, notes)
        return cls.build(ids, vectors, provenance_of(e.meta), backend=backend)

    # ---- reading and writing ----------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Index:
        """The index at ``path``, once its manifest, sizes and checksums pass (:func:`vitkit.search.format.verify`);
        :class:`~vitkit.search.format.IndexFileError` (one line) otherwise."""
        folder = complete_dir(Path(path))
        doc = fmt.verify(folder)
        count, dim = doc["count"], doc["dimension"]
        ids = fmt.read_ids(folder, count)
        name = doc["backend"]["name"]
        if name == "exact" or count == 0:  # exact search reads every vector: in memory
            vectors = np.fromfile(folder / fmt.VECTORS, dtype="<f4").reshape(count, dim)
        else:  # the graph/lists hold their own copy; these are read only to score candidates: mapped, not loaded
            vectors = np.memmap(folder / fmt.VECTORS, dtype="<f4", mode="r", shape=(count, dim))
        graph = None
        if name in ("hnsw", "ivf"):
            graph = ann.structure(name).load(folder / (fmt.GRAPH if name == "hnsw" else fmt.LISTS), dim, count,
                                             doc["backend"])  # fmt: skip
        elif name != "exact":
            raise fmt.IndexFileError(f"{folder}: backend {name!r} is not one this vitkit knows ({', '.join(BACKENDS)})")
        return cls(ids, vectors, doc["provenance"], doc["backend"], graph)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the index to the folder ``path`` (crash-safe: old or new, never half). An existing ``path`` is
        replaced only with ``overwrite`` and only when it is a vitkit index."""
        out = Path(path)
        clean_stale(out.parent, [out.name])
        if os.path.lexists(out):
            if not overwrite:
                raise ConfigError(f"--out {out}: exists; choose a new path (or --overwrite an index there)")
            fmt.read_manifest(out)  # only a vitkit index is replaced

        def write(tmp: Path) -> None:
            (tmp / fmt.IDS).write_text(json.dumps(self.ids, ensure_ascii=False), encoding="utf-8")
            np.ascontiguousarray(self.vectors, dtype="<f4").tofile(tmp / fmt.VECTORS)
            if self._graph is not None:
                self._graph.save(tmp / (fmt.LISTS if self.backend["name"] == "ivf" else fmt.GRAPH))
            doc = fmt.manifest_doc(dimension=self.dimension, count=len(self), backend=self.backend,
                                   provenance=self.provenance, folder=tmp)  # fmt: skip
            (tmp / fmt.MANIFEST).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

        write_dir_atomic(out, write)
        return out

    # ---- changing ---------------------------------------------------------------------------------------

    def check_comparable(self, meta: Mapping[str, str], where: str) -> None:
        """DataError naming ``where`` when vectors made with ``meta`` cannot be compared with this index's."""
        check_same(meta, self.provenance, where, COMPARED, against="the index",
                   advice="embed with the index's checkpoint and options")  # fmt: skip

    def add(self, ids: Sequence[str], vectors: np.ndarray, provenance: Mapping[str, str] | None = None) -> int:
        """Append ``vectors`` under ``ids`` (ids already in the index are skipped, so a repeated add after a kill
        completes rather than fails); returns how many were added. ``provenance`` must match the index's."""
        self.check_comparable(dict(provenance or {}), "the vectors to add")
        ids = [text_id(str(i)) for i in ids]
        v = np.asarray(vectors)
        if v.ndim != 2 or len(v) != len(ids) or v.shape[1] != self.dimension:
            raise DataError(f"vectors of shape {v.shape} for {len(ids)} ids do not fit an index of dimension "
                            f"{self.dimension}")  # fmt: skip
        rows = self._row_of()
        keep, seen = [], set()
        for i, name in enumerate(ids):
            if name not in rows and name not in seen:
                keep.append(i)
                seen.add(name)
        if not keep:
            return 0
        new = _finite_normalised(v[keep])
        start = len(self)
        self.ids = self.ids + [ids[i] for i in keep]
        self.vectors = np.concatenate([self.vectors, new]) if start else new
        if self._graph is not None:
            self._graph.add(new, start)
        self._rows = None
        return len(keep)

    def add_embeddings(self, source: str | os.PathLike[str] | Embeddings, notes: list[str] | None = None) -> int:
        """:meth:`add` the rows of an embedding output (those of failed images left out)."""
        e = read_embeddings(source) if not isinstance(source, Embeddings) else source
        where = f"{source}" if not isinstance(source, Embeddings) else "the embeddings"
        self.check_comparable(e.meta, where)
        ids, vectors = _usable(e, notes)
        return self.add(ids, vectors, e.meta)

    def remove(self, ids: Iterable[str]) -> int:
        """Drop ``ids`` (those not in the index are ignored); returns how many were removed. The approximate
        backend's graph is rebuilt from the vectors that stay."""
        rows = self._row_of()
        drop = {rows[text_id(str(i))] for i in ids if text_id(str(i)) in rows}
        if not drop:
            return 0
        keep = np.setdiff1d(np.arange(len(self)), np.fromiter(drop, dtype=np.int64))
        self.ids = [self.ids[i] for i in keep]
        self.vectors = np.ascontiguousarray(self.vectors[keep])
        if self._graph is not None:
            self._graph = ann.structure(self.backend["name"]).build(self.vectors, self.backend)
        self._rows = None
        return len(drop)

    # ---- searching --------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dimension(self) -> int:
        """The length of every vector."""
        return int(self.vectors.shape[1])

    def _row_of(self) -> dict[str, int]:
        if self._rows is None:
            self._rows = {name: i for i, name in enumerate(self.ids)}
        return self._rows

    def vector(self, id: str) -> np.ndarray:
        """The stored (normalised) vector of ``id``; DataError when it is not in the index."""
        row = self._row_of().get(id)
        if row is None:
            raise DataError(f"id:{id}: not in the index")
        return self.vectors[row]

    def search_rows(self, queries: np.ndarray, k: int, *, exact: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (M, min(k, N)), best first, for queries (M, D) (normalised here). ``exact``: force
        exact search (default: the index's backend)."""
        q = np.asarray(queries, dtype=np.float32)
        if q.ndim == 1:
            q = q[None]
        if q.ndim != 2 or q.shape[1] != self.dimension:
            raise DataError(f"queries of shape {q.shape} do not fit an index of dimension {self.dimension}")
        if k < 1:
            raise ConfigError(f"--top-k {k}: must be at least 1")
        q = normalise(q)
        kk = min(k, len(self))
        if kk == 0:
            return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64)
        if self._graph is None or exact:
            return exact_search(self.vectors, q, kk)
        rows = self._graph.search(q, kk)
        scores = np.einsum("md,mkd->mk", q, self.vectors[rows])  # exact scores of the candidates
        order = np.lexsort((rows, -scores), axis=-1)  # by score descending, ties by row ascending
        return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)

    def search(self, queries: np.ndarray, k: int = 10) -> list[list[Hit]]:
        """The ``k`` nearest ids of each query vector, with their cosine scores, best first."""
        scores, rows = self.search_rows(queries, k)
        return [[Hit(self.ids[r], float(s)) for s, r in zip(srow, rrow, strict=True)]
                for srow, rrow in zip(scores, rows, strict=True)]  # fmt: skip

    def search_ids(self, ids: Sequence[str], k: int = 10) -> list[list[Hit]]:
        """Neighbours of vectors already in the index (each id itself left out)."""
        hits = self.search(np.stack([self.vector(i) for i in ids]) if ids else np.zeros((0, self.dimension)), k + 1)
        return [[h for h in row if h.id != i][:k] for i, row in zip(ids, hits, strict=True)]


def _finite_normalised(v: np.ndarray) -> np.ndarray:
    """The vectors L2-normalised (:func:`~vitkit.search.exact.normalise`); DataError when some are not finite."""
    if not np.isfinite(v).all():
        raise DataError("some vectors are not finite (NaN: images that failed to embed)")
    return normalise(v)


def _usable(e: Embeddings, notes: list[str] | None) -> tuple[list[str], np.ndarray]:
    """The ids and vectors of an embedding output without the rows of images that failed."""
    if e.vectors.ndim != 2:
        raise DataError(f"embeddings of shape {tuple(e.vectors.shape[1:])} per image: an index takes one vector per "
                        "image (embed without --pool tokens)")  # fmt: skip
    if not e.errors:
        return list(e.ids), np.asarray(e.vectors)
    keep = np.setdiff1d(np.arange(len(e)), np.fromiter(e.errors, dtype=np.int64, count=len(e.errors)))
    if notes is not None:
        notes.append(f"{len(e.errors)} image(s) that failed to embed left out")
    return [e.ids[i] for i in keep], np.asarray(e.vectors)[keep]
