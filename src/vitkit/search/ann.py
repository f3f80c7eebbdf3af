"""The approximate backends of ``vitkit index``; each proposes candidate rows, which the index then scores exactly.

- ``--backend ivf`` (:class:`Lists`): an inverted file -- spherical k-means into about sqrt(N) lists, each query
  scored by blocked matrix products against the vectors of its ``nprobe`` (8) nearest lists. vitkit's own code
  (torch), nothing to install; on 1M clustered 384-d vectors recall@10 0.999 at 21x exact search's queries/s,
  memory 1.006x the raw vectors (BENCHMARKS.md, "Similarity search").
- ``--backend hnsw`` (:class:`Graph`): an HNSW graph (Malkov & Yashunin, 2018) built by hnswlib, the library chosen
  by measurement among faiss-cpu, hnswlib and usearch. It is the optional extra ``vitkit[search]``; without it,
  ``--backend hnsw`` is one line naming it. At M=16 its recall@10 at 1M was 0.866 (efSearch 128).

Both work over inner products of the index's L2-normalised vectors (= cosine similarity); their labels are the rows
of ``vectors.f32``. Their files are read only after the manifest's size and checksum of each have passed
(:func:`vitkit.search.format.verify`); an index keeps the parameters it was built with in its manifest, so older
indices load with theirs.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.errors import ConfigError
from vitkit.hardware import cpu_count
from vitkit.search.format import IndexFileError

NAME = "hnsw"
LIBRARY = "hnswlib"
M = 16  # links per node (level 0: 2M): memory per vector 4 * 2M + ~40 bytes beyond the float32 vector
EF_CONSTRUCTION = 100
EF_SEARCH = 128  # BENCHMARKS.md: recall@10 0.998 on 200k clustered 384-d vectors (64: 0.981)


def structure(name: str) -> Any:
    """The class (:class:`Graph` or :class:`Lists`) of the approximate backend ``name``."""
    return Lists if name == IVF_NAME else Graph


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
    library()
    return {"name": NAME, "library": LIBRARY, "version": version(LIBRARY), "M": M,
            "ef_construction": EF_CONSTRUCTION, "ef_search": ef_search}  # fmt: skip


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
        index.set_num_threads(cpu_count())
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
            raise IndexFileError(f"{path.parent}: its graph holds {index.get_current_count()} vectors, not {count}")
        index.set_num_threads(cpu_count())
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


# ---- IVF: k-means lists probed with exact products -------------------------------------------------------

IVF_NAME = "ivf"
IVF_NPROBE = 8  # BENCHMARKS.md: recall@10 0.9987 at 1M (21x exact's q/s), 0.983 at 200k
IVF_SAMPLE_PER_LIST = 256  # k-means is trained on at most this many vectors per list
IVF_ITERATIONS = 10


def ivf_lists(n: int) -> int:
    """The number of k-means lists for ``n`` vectors: about sqrt(n)."""
    return max(1, min(n, round(float(np.sqrt(max(n, 1))))))


def _nearest(x: Any, centres: Any, block: int = 65536) -> Any:
    """Per row of ``x`` (torch, N x D) the index of the centre with the highest inner product."""
    out = torch.empty(len(x), dtype=torch.int64)
    for s in range(0, len(x), block):
        out[s : s + block] = (x[s : s + block] @ centres.T).argmax(dim=1)
    return out


def kmeans(x: np.ndarray, lists: int, iterations: int = IVF_ITERATIONS, seed: int = 0) -> np.ndarray:
    """Spherical k-means: ``lists`` unit centres (lists, D) of the unit rows of ``x`` (a sample, seeded)."""
    rng = np.random.default_rng(seed)
    n = len(x)
    take = min(n, lists * IVF_SAMPLE_PER_LIST)
    sample = torch.from_numpy(np.ascontiguousarray(x[np.sort(rng.choice(n, take, replace=False))], dtype=np.float32))
    centres = sample[torch.from_numpy(rng.choice(take, lists, replace=False))].clone()
    for _ in range(iterations):
        near = _nearest(sample, centres)
        sums = torch.zeros_like(centres).index_add_(0, near, sample)
        counts = torch.bincount(near, minlength=lists)
        empty = (counts == 0).nonzero().flatten()
        if len(empty):  # reseed empty lists with random sample points
            sums[empty] = sample[torch.from_numpy(rng.choice(take, len(empty), replace=False))]
        centres = sums / sums.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return centres.numpy()


def ivf_params(n: int, nprobe: int = IVF_NPROBE) -> dict[str, Any]:
    """The backend entry of a new IVF index's manifest (vitkit's own code: no library)."""
    return {"name": IVF_NAME, "lists": ivf_lists(n), "nprobe": nprobe, "iterations": IVF_ITERATIONS, "seed": 0}


class Lists:
    """An inverted file: unit centres (L, D) from k-means and, list after list, the rows nearest each centre with a
    copy of their vectors in that order, so a list is one contiguous block for a matrix product."""

    def __init__(self, centres: np.ndarray, offsets: np.ndarray, rows: np.ndarray, vectors: np.ndarray,
                 nprobe: int) -> None:  # fmt: skip
        self.centres, self.offsets, self.rows, self.vectors = centres, offsets, rows, vectors
        self.nprobe = nprobe

    @classmethod
    def _arrange(cls, vectors: np.ndarray, rows: np.ndarray, near: np.ndarray, centres: np.ndarray,
                 nprobe: int) -> Lists:  # fmt: skip
        order = np.argsort(near, kind="stable")
        offsets = np.zeros(len(centres) + 1, dtype=np.int64)
        np.cumsum(np.bincount(near, minlength=len(centres)), out=offsets[1:])
        return cls(centres, offsets, np.ascontiguousarray(rows[order]), np.ascontiguousarray(vectors[order]), nprobe)

    @classmethod
    def build(cls, vectors: np.ndarray, backend: dict[str, Any]) -> Lists:
        """Lists over the rows of the unit ``vectors`` (N, D) with the manifest entry ``backend``'s parameters."""
        n, d = vectors.shape
        lists = max(1, min(int(backend["lists"]), n))
        if not n:
            return cls(np.zeros((1, d), np.float32), np.zeros(2, np.int64), np.zeros(0, np.int64),
                       np.zeros((0, d), np.float32), int(backend["nprobe"]))  # fmt: skip
        centres = kmeans(vectors, lists, int(backend.get("iterations", IVF_ITERATIONS)), int(backend.get("seed", 0)))
        near = _nearest(torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)),
                        torch.from_numpy(centres)).numpy()  # fmt: skip
        return cls._arrange(vectors, np.arange(n, dtype=np.int64), near, centres, int(backend["nprobe"]))

    def add(self, vectors: np.ndarray, start: int) -> None:
        """Append ``vectors`` as rows ``start``, ... to their nearest lists (the centres stay as trained)."""
        if not len(vectors):
            return
        near_new = _nearest(torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)),
                            torch.from_numpy(self.centres)).numpy()  # fmt: skip
        near_old = np.repeat(np.arange(len(self.centres)), np.diff(self.offsets))
        rows = np.concatenate([self.rows, np.arange(start, start + len(vectors), dtype=np.int64)])
        both = np.concatenate([self.vectors, np.asarray(vectors, dtype=np.float32)])
        new = Lists._arrange(both, rows, np.concatenate([near_old, near_new]), self.centres, self.nprobe)
        self.offsets, self.rows, self.vectors = new.offsets, new.rows, new.vectors

    def save(self, path: Path) -> None:
        """Write centres, offsets, rows and vectors, raw little-endian, in that order (sizes from the manifest)."""
        with open(path, "wb") as f:
            for a, dt in ((self.centres, "<f4"), (self.offsets, "<i8"), (self.rows, "<i8"), (self.vectors, "<f4")):
                f.write(np.ascontiguousarray(a, dtype=dt).tobytes())

    @staticmethod
    def lists_in(size: int, count: int, dimension: int) -> int:
        """How many lists a file of ``size`` bytes holds (0 when the size fits no whole number of lists)."""
        rest = size - 8 - count * (8 + 4 * dimension)
        return rest // (4 * dimension + 8) if rest > 0 and rest % (4 * dimension + 8) == 0 else 0

    @classmethod
    def load(cls, path: Path, dimension: int, count: int, backend: dict[str, Any]) -> Lists:
        """The lists file of a verified index (its size and checksum already checked)."""
        lists = cls.lists_in(path.stat().st_size, count, dimension)
        if not lists or lists > max(1, count):
            raise IndexFileError(f"{path.parent}: its lists file's size does not fit {count} vectors of dimension "
                                 f"{dimension}")  # fmt: skip
        c_end = lists * dimension * 4
        o_end = c_end + (lists + 1) * 8
        r_end = o_end + count * 8
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        centres = np.frombuffer(raw[:c_end], dtype="<f4").reshape(lists, dimension).astype(np.float32)
        offsets = np.frombuffer(raw[c_end:o_end], dtype="<i8").astype(np.int64)
        rows = np.frombuffer(raw[o_end:r_end], dtype="<i8").astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != count or (np.diff(offsets) < 0).any() or \
                (count and (rows.min() < 0 or rows.max() >= count)):  # fmt: skip
            raise IndexFileError(f"{path.parent}: its lists file's offsets or rows are out of range")
        vectors = np.fromfile(path, dtype="<f4", offset=r_end).reshape(count, dimension)
        return cls(centres, offsets, rows, vectors, int(backend["nprobe"]))

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Rows (M, k) of the top ``k`` per query among the vectors of its ``nprobe`` nearest lists (more lists
        when those hold fewer than ``k``). k at most the number of vectors."""
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        m, lists = len(q), len(self.centres)
        sizes = np.diff(self.offsets)
        probe = min(lists, self.nprobe)
        near = (q @ torch.from_numpy(self.centres).T).topk(probe, dim=1).indices.numpy()
        while probe < lists and (sizes[near].sum(axis=1) < k).any():  # too few candidates: probe more lists
            probe = min(lists, probe * 2)
            near = (q @ torch.from_numpy(self.centres).T).topk(probe, dim=1).indices.numpy()
        kk = min(k, int(sizes.max()))
        cand_s = torch.full((m, probe, kk), -float("inf"))
        cand_i = torch.zeros((m, probe, kk), dtype=torch.int64)
        flat = near.ravel()
        order = np.argsort(flat, kind="stable")
        bounds = np.searchsorted(flat[order], np.arange(lists + 1))
        vec = torch.from_numpy(self.vectors)
        for lst in np.flatnonzero(np.diff(bounds)):
            a, b = self.offsets[lst], self.offsets[lst + 1]
            if a == b:
                continue
            who = torch.from_numpy(order[bounds[lst] : bounds[lst + 1]])
            qi, slot = who // probe, who % probe
            s, i = (q[qi] @ vec[a:b].T).topk(min(kk, int(b - a)), dim=1)
            cand_s[qi, slot, : s.shape[1]] = s
            cand_i[qi, slot, : s.shape[1]] = i + int(a)
        best = cand_s.reshape(m, -1).topk(k, dim=1).indices
        return self.rows[cand_i.reshape(m, -1).gather(1, best).numpy()]
