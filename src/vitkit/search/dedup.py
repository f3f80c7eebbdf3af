"""Near-duplicate groups of an index: the connected components of its neighbour graph (each vector's ``k``
nearest neighbours, an edge where their cosine similarity is at least ``threshold``), found by union-find.

Each group of two or more images is listed with a representative first (the image indexed first) and every
member's cosine similarity to it; the distribution of each image's best neighbour score is drawn as a histogram
(with the threshold marked) so a user can see where the duplicates separate from the merely similar.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vitkit.errors import ConfigError
from vitkit.fileio import write_file_atomic
from vitkit.search.index import Index

DEFAULT_THRESHOLD = 0.95
DEFAULT_K = 10
_QUERY_BLOCK = 8192


@dataclass
class Groups:
    """``groups``: rows of the index per group, representative first; ``scores``: each member's cosine to its
    group's representative (the same layout); ``best``: each image's best neighbour score (N,), NaN alone."""

    groups: list[list[int]]
    scores: list[list[float]]
    best: np.ndarray
    threshold: float


def _find(parent: np.ndarray, i: int) -> int:
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:
        parent[i], i = root, parent[i]
    return root


def find_groups(index: Index, threshold: float = DEFAULT_THRESHOLD, k: int = DEFAULT_K) -> Groups:
    """The near-duplicate groups of ``index`` (module docstring)."""
    if not -1.0 <= threshold <= 1.0 or threshold != threshold:
        raise ConfigError(f"--threshold {threshold}: a cosine similarity, -1..1")
    if k < 1:
        raise ConfigError(f"--k {k}: must be at least 1")
    n = len(index)
    parent = np.arange(n)
    best = np.full(n, np.nan, dtype=np.float32)
    for q0 in range(0, n, _QUERY_BLOCK):
        rows = np.arange(q0, min(n, q0 + _QUERY_BLOCK))
        scores, nbrs = index.search_rows(index.vectors[rows], k + 1)
        for r, srow, nrow in zip(rows, scores, nbrs, strict=True):
            others = nrow != r
            if others.any():
                best[r] = srow[others][0]
            for s, j in zip(srow[others], nrow[others], strict=True):
                if s < threshold:
                    break
                a, b = _find(parent, int(r)), _find(parent, int(j))
                if a != b:
                    parent[max(a, b)] = min(a, b)  # the root is the group's first row
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(_find(parent, i), []).append(i)
    groups = [m for _, m in sorted(members.items()) if len(m) > 1]
    to_rep = [[float(index.vectors[m] @ index.vectors[g[0]]) for m in g] for g in groups]
    return Groups(groups, to_rep, best, threshold)


def plot_scores(found: Groups, path: str | os.PathLike[str]) -> Path:
    """A histogram of each image's best neighbour score with the threshold marked, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from PIL import Image

    best = found.best[np.isfinite(found.best)]
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    ax.hist(best, bins=100, range=(min(-0.0, float(best.min())) if len(best) else 0.0, 1.0), color="#4472c4")
    ax.axvline(found.threshold, color="#c00000", linestyle="--", label=f"threshold {found.threshold:g}")
    ax.set_yscale("log")
    ax.set_xlabel("cosine similarity of each image to its nearest other image")
    ax.set_ylabel("images")
    above = int((best >= found.threshold).sum())
    ax.set_title(f"{above} of {len(best)} images have a neighbour at or above the threshold")
    ax.legend()
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    png = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3])
    return write_file_atomic(Path(path), lambda tmp: png.save(tmp, format="PNG", optimize=True))
