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


def test_ivf_recall_and_exact_scores_against_brute_force(tmp_path: Path) -> None:
    both = clustered(6200, 64, clusters=60, seed=2)  # queries: further draws from the same mixture
    data, q = both[:6000], both[6000:]
    ivf = Index.build(ids(6000), data, backend="ivf")
    assert ivf.backend["name"] == "ivf" and ivf.backend["lists"] == 77
    unit = data / np.linalg.norm(data, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    want = np.argsort(-(qn @ unit.T), axis=1, kind="stable")[:, :10]  # the brute-force reference
    s, got = ivf.search_rows(q, 10)
    assert np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got, want, strict=True)]) >= 0.95
    np.testing.assert_allclose(s, np.einsum("md,mkd->mk", qn, unit[got]), atol=1e-6)
    ivf.save(tmp_path / "ix")
    assert {p.name for p in (tmp_path / "ix").iterdir()} >= {"lists.ivf", "vectors.f32"}
    back = Index.open(tmp_path / "ix")
    np.testing.assert_array_equal(back.search_rows(q, 10)[1], got)


def test_ivf_add_remove_and_small_lists() -> None:
    data = clustered(3000, 32, clusters=30, seed=4)
    index = Index.build(ids(2000), data[:2000], backend="ivf")
    assert index.add(ids(1000, 2000), data[2000:]) == 1000
    exact = Index.build(ids(3000), data)
    assert _recall(index, exact, data[::20]) >= 0.95
    assert index.remove(ids(2990)) == 2990  # 10 left: fewer per list than k, so more lists are probed
    hits = index.search(data[:5], 10)
    assert all(len(row) == 10 and {h.id for h in row} == set(ids(10, 2990)) for row in hits)


def test_ivf_truncated_lists_file_is_one_line(tmp_path: Path) -> None:
    from vitkit.search.format import IndexFileError

    Index.build(ids(500), clustered(500, 16, clusters=5), backend="ivf").save(tmp_path / "ix")
    f = tmp_path / "ix" / "lists.ivf"
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(IndexFileError, match=r"lists\.ivf"):
        Index.open(tmp_path / "ix")
