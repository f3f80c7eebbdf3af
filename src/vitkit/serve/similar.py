"""Similar images for ``vitkit serve --index INDEX``: the served checkpoint embeds an uploaded image as the index's
vectors were embedded (the same pooling and layer), and the index answers its nearest neighbours.

An index answers only queries embedded by the checkpoint that made it: at start-up the served checkpoint's weights
digest and preprocessing are compared with the index's provenance (:data:`vitkit.search.index.COMPARED`), and a
mismatch is refused in one line before the server listens. The precision may differ (bf16 rounds the vectors; the
neighbours and their order are what the checkpoint computes, to that rounding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.errors import DataError
from vitkit.inference.embed import EmbedOptions, vector_shape
from vitkit.search.index import Index
from vitkit.search.jobs import checkpoint_meta
from vitkit.serve.engine import ServedModel


@dataclass(frozen=True)
class SimilarImages:
    """An index and the embedding options its vectors were made with (``pool``/``layer`` as ``vitkit embed``)."""

    index: Index
    source: str
    pool: str | None
    layer: int | None

    @classmethod
    def open(cls, path: str | os.PathLike[str], served: ServedModel) -> SimilarImages:
        """The index at ``path`` for ``served``'s checkpoint; DataError (one line, naming ``--index``) when the
        index was embedded by another checkpoint, another preprocessing, or at a shape the model cannot give."""
        index = Index.open(path)
        where = f"--index {path}"
        found = {**index.provenance, **checkpoint_meta(served.loaded)}
        index.check_comparable(found, where)
        pool = index.provenance.get("vitkit.embed.pool", "pre-logits")
        layer = index.provenance.get("vitkit.embed.layer", "final")
        if pool == "tokens":
            raise DataError(f"{where}: an index of token grids (--pool tokens) cannot be searched by image")
        similar = cls(
            index, str(path), None if pool == "pre-logits" else pool, None if layer == "final" else int(layer)
        )
        (dim,) = vector_shape(served.loaded, EmbedOptions(pool=similar.pool, layer=similar.layer))
        if dim != index.dimension:
            raise DataError(f"{where}: the index holds vectors of dimension {index.dimension}, the checkpoint "
                            f"gives {dim}")  # fmt: skip
        return similar

    def vectors(self, served: ServedModel, x: torch.Tensor) -> np.ndarray:
        """Preprocessed images (B, C, H, W) -> their vectors (B, D), float32, as the index's were embedded."""
        out = served.engine.features(x, layer=self.layer, pool=self.pool)
        return out.reshape(len(x), -1).numpy()

    def neighbours(self, vector: np.ndarray, k: int, skip: str | None = None) -> list[dict[str, Any]]:
        """The ``k`` nearest indexed images of one vector (``skip``: an id left out, the query itself)."""
        hits = self.index.search(vector[None], k + (skip is not None))[0]
        return [{"id": h.id, "score": round(h.score, 6)} for h in hits if h.id != skip][:k]

    def by_id(self, id: str, k: int) -> list[dict[str, Any]]:
        """The neighbours of an indexed image (itself left out); DataError when the id is not in the index."""
        return self.neighbours(np.asarray(self.index.vector(id)), k, skip=id)

    def card(self) -> dict[str, Any]:
        """What ``GET /model`` says of the index."""
        return {
            "index": "/".join(Path(os.path.normpath(self.source)).parts[-2:]),
            "images": len(self.index),
            "dimension": self.index.dimension,
            "backend": self.index.backend.get("name", "exact"),
            "pool": self.pool or "pre-logits",
            "layer": "final" if self.layer is None else self.layer,
        }
