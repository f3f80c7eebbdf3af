"""Exact cosine search: the ground truth every approximate backend is measured against.

Both sides are L2-normalised float32; the similarities are computed in blocks of ``query_block`` x ``bank_block``
(matrix products, the same blocking as ``vitkit knn``), only one block held at a time, and the top ``k`` kept per
query across blocks. Ties in score go to the earlier row, as a stable sort of the whole bank would order them.
"""

from __future__ import annotations

import numpy as np
import torch

QUERY_BLOCK = 256
BANK_BLOCK = 65536


def normalise(x: np.ndarray) -> np.ndarray:
    """(N, D) -> float32 rows divided by their L2 norms (rows of zeros stay zero)."""
    a = np.array(x, dtype=np.float32, copy=True)
    norms = np.linalg.norm(a, axis=1, keepdims=True)
    np.divide(a, norms, out=a, where=norms > 0)
    return a


def _rank(values: torch.Tensor, tiebreak: torch.Tensor) -> torch.Tensor:
    """Per row, the column order by ``values`` descending, ties by ``tiebreak`` ascending."""
    by_tie = tiebreak.argsort(dim=1, stable=True)
    v = values.gather(1, by_tie)
    return by_tie.gather(1, (-v).argsort(dim=1, stable=True))


@torch.inference_mode()
def exact_search(
    bank: np.ndarray,
    queries: np.ndarray,
    k: int,
    *,
    query_block: int = QUERY_BLOCK,
    bank_block: int = BANK_BLOCK,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores (M, k') float32, rows (M, k') int64) of the ``k`` rows of ``bank`` (N, D) with the highest inner
    product with each of ``queries`` (M, D), best first; ``k' = min(k, N)``. Both are used as given: normalise
    them (:func:`normalise`) for cosine similarity."""
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    n = len(bank)
    kk = min(k, n)
    q_all = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    scores = np.empty((len(q_all), kk), dtype=np.float32)
    rows = np.empty((len(q_all), kk), dtype=np.int64)

    def bank_at(b0: int) -> torch.Tensor:
        """The bank's block of rows from ``b0``, as float32."""
        return torch.from_numpy(np.ascontiguousarray(bank[b0 : b0 + bank_block], dtype=np.float32))

    blocks = [bank_at(b0) for b0 in range(0, n, bank_block)] if n <= 4 * bank_block else None  # converted once
    for q0 in range(0, len(q_all), query_block):
        q = q_all[q0 : q0 + query_block]
        best_s = torch.full((len(q), 0), -float("inf"))
        best_i = torch.zeros((len(q), 0), dtype=torch.int64)
        for j, b0 in enumerate(range(0, n, bank_block)):
            block = blocks[j] if blocks is not None else bank_at(b0)
            sim = q @ block.T
            s, i = sim.topk(min(kk, sim.shape[1]), dim=1)
            cand_s, cand_i = torch.cat([best_s, s], dim=1), torch.cat([best_i, i + b0], dim=1)
            order = _rank(cand_s, cand_i)[:, :kk]
            best_s, best_i = cand_s.gather(1, order), cand_i.gather(1, order)
        scores[q0 : q0 + len(q)] = best_s.numpy()
        rows[q0 : q0 + len(q)] = best_i.numpy()
    return scores, rows
