"""Vectors for the search tests: clustered unit vectors (a mixture of Gaussian blobs on the sphere), so that
nearest neighbours are meaningfully nearer than the rest, as image features are."""

from __future__ import annotations

import numpy as np


def clustered(n: int, dim: int, clusters: int = 50, spread: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(0, clusters, n)] + rng.standard_normal((n, dim)).astype(np.float32) * (spread / dim**0.5)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def ids(n: int, start: int = 0) -> list[str]:
    return [f"img/{i:07d}.jpg" for i in range(start, start + n)]
