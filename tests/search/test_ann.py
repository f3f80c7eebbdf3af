"""The approximate backend (hnswlib's HNSW graph): recall@10 against exact search on clustered vectors, exact
scores for the candidates it finds, add and remove, saved and read back, and one line when hnswlib is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from search_helpers import clustered, ids

from vitkit.errors import ConfigError
from vitkit.search import Index

pytest.importorskip("hnswlib")


def _recall(a: Index, b: Index, q: np.ndarray, k: int = 10) -> float:
    _, got = a.search_rows(q, k)
    _, want = b.search_rows(q, k, exact=True)
    return float(np.mean([len(set(g) & set(w)) / k for g, w in zip(got, want, strict=True)]))


def test_recall_at_10_against_exact(tmp_path: Path) -> None:
    data = clustered(6000, 64, clusters=60, seed=2)
    q = clustered(200, 64, clusters=60, seed=2)[:200] + 0.0
    hnsw = Index.build(ids(6000), data, backend="hnsw")
    exact = Index.build(ids(6000), data)
    assert _recall(hnsw, exact, q) >= 0.95
    hnsw.save(tmp_path / "ix")
    back = Index.open(tmp_path / "ix")
    assert back.backend["name"] == "hnsw" and _recall(back, exact, q) >= 0.95
    s, r = back.search_rows(q[:5], 10)
    np.testing.assert_allclose(s, np.einsum("md,mkd->mk", q[:5] / np.linalg.norm(q[:5], axis=1, keepdims=True),
                                            exact.vectors[r]), atol=1e-6)  # fmt: skip
    assert (np.diff(s, axis=1) <= 0).all()


def test_add_and_remove_keep_recall(tmp_path: Path) -> None:
    data = clustered(4000, 32, clusters=40, seed=4)
    index = Index.build(ids(3000), data[:3000], backend="hnsw")
    assert index.add(ids(1000, 3000), data[3000:]) == 1000
    assert index.add(ids(10, 3000), data[3000:3010]) == 0  # already there: skipped
    exact = Index.build(ids(4000), data)
    assert _recall(index, exact, data[::20]) >= 0.95
    assert index.remove(ids(2000)) == 2000
    assert index.ids == ids(2000, 2000)
    hits = index.search(data[:50], 5)
    assert all(h.id not in set(ids(2000)) for row in hits for h in row)
    index.save(tmp_path / "ix")
    assert Index.open(tmp_path / "ix").ids == ids(2000, 2000)


def test_missing_library_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hnswlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'vitkit\[search\]'"):
        Index.build(ids(3), clustered(3, 4), backend="hnsw")
