"""Exact search equals a brute-force numpy reference: the same ids at every rank (or, where the reference has two
scores within 1e-6, one of the tied ids) and scores within 1e-6, over blocks of bank and queries."""

from __future__ import annotations

import numpy as np
import pytest
from search_helpers import clustered, ids

from vitkit.search import Index
from vitkit.search.exact import exact_search, normalise


def _reference(bank: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    sims = queries.astype(np.float64) @ bank.astype(np.float64).T
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, order, 1), order, sims


def _check(n: int, dim: int, m: int, k: int, **blocks: int) -> None:
    bank = normalise(clustered(n, dim, clusters=max(2, n // 200), seed=1))
    queries = normalise(clustered(m, dim, clusters=max(2, n // 200), seed=1)[:m] + 0.01)
    scores, rows = exact_search(bank, queries, k, **blocks)
    ref_s, ref_i, sims = _reference(bank, queries, k)
    assert rows.shape == ref_i.shape == (m, k)
    np.testing.assert_allclose(scores, ref_s, atol=1e-6, rtol=0)
    differ = rows != ref_i
    # a different id only where the reference itself cannot tell the two apart
    tied = np.abs(np.take_along_axis(sims, rows, 1) - ref_s) <= 1e-6
    assert (~differ | tied).all(), f"{int(differ.sum())} ranks differ beyond ties"
    assert differ.mean() < 0.01


def test_exact_equals_numpy_on_100k_vectors() -> None:
    _check(100_000, 384, 64, 10)


def test_exact_blocks_edges_and_k_above_n() -> None:
    _check(1000, 16, 37, 7, query_block=5, bank_block=97)  # partial blocks of both
    bank = normalise(clustered(5, 8))
    s, r = exact_search(bank, bank, 10)
    assert s.shape == (5, 5) and (r[:, 0] == np.arange(5)).all()


def test_index_search_reports_ids_and_normalises() -> None:
    v = clustered(2000, 32, seed=3) * 7.5  # not unit: the index normalises
    index = Index.build(ids(2000), v)
    hits = index.search(v[:3], 4)
    assert [h[0].id for h in hits] == ids(3)
    assert all(abs(h[0].score - 1.0) < 1e-5 for h in hits)
    around = index.search_ids([ids(1)[0]], 3)[0]
    assert ids(1)[0] not in [h.id for h in around] and len(around) == 3


@pytest.mark.parametrize("bad", ["nan", "tokens", "repeat"])
def test_build_refuses_what_cannot_be_indexed(bad: str) -> None:
    from vitkit.errors import DataError

    v = clustered(10, 8)
    names = ids(10)
    if bad == "nan":
        v[3, 0] = np.nan
    elif bad == "tokens":
        v = np.zeros((10, 4, 8), np.float32)
    else:
        names[5] = names[4]
    with pytest.raises(DataError):
        Index.build(names, v)
