"""Similar images for ``vitkit serve --index INDEX``: the served checkpoint embeds an uploaded image as the index's
vectors were embedded (the same pooling and layer), and the index answers its nearest neighbours.

An index answers only queries embedded by the checkpoint that made it: at start-up the served checkpoint's weights
digest and preprocessing are compared with the index's provenance (:data:`vitkit.search.index.COMPARED`), and a
mismatch is refused in one line before the server listens. The precision may differ (bf16 rounds the vectors; the
neighbours and their order are what the checkpoint computes, to that rounding).

Thumbnails (``GET /thumbnail?id=`` and the demo's "Similar images" tab) show indexed images and nothing else on disk:
an id is served only when it is in the index, names a path without ``..`` parts, and that path, its links resolved
when asked for, lies in the indexed folder (the deepest folder holding every indexed file, links not resolved) and is
a regular file; anything else is :class:`NotServed` (404). The file is read with vitkit's bounds
(:func:`vitkit.images.read_image_file`), decoded by the caller's decoder (the server's worker processes, with its
pixel limit and decode timeout) and re-encoded as a JPEG of at most :data:`THUMBNAIL_PX` pixels a side: the raw file
never leaves the server.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.errors import DataError
from vitkit.images import convert_image, read_image_file
from vitkit.inference.embed import EmbedOptions, vector_shape
from vitkit.search.index import Index
from vitkit.search.operations import checkpoint_meta, settings_of
from vitkit.serve.served_model import ServedModel

THUMBNAIL_PX = 256  # the longest side of a thumbnail, in pixels
THUMBNAIL_QUALITY = 85  # JPEG quality of the thumbnails


class NotServed(DataError):
    """An id whose image is not served: not in the index, or not a file in the indexed folder."""


@dataclass(frozen=True)
class SimilarImages:
    """An index and the embedding options its vectors were made with (``pool``/``layer`` as ``vitkit embed``)."""

    index: Index
    source: str
    pool: str | None
    layer: int | None
    root: str | None = None  # the indexed folder (absolute, links not resolved); None: no files
    cwd: str = field(default_factory=os.getcwd)  # what relative ids are relative to: the folder at start-up

    @classmethod
    def open(cls, path: str | os.PathLike[str], served: ServedModel) -> SimilarImages:
        """The index at ``path`` for ``served``'s checkpoint; DataError (one line, naming ``--index``) when the
        index was embedded by another checkpoint, another preprocessing, or at a shape the model cannot give."""
        index = Index.open(path)
        where = f"--index {path}"
        found = {**index.provenance, **checkpoint_meta(served.loaded)}
        index.check_comparable(found, where)
        if index.provenance.get("vitkit.embed.pool") == "tokens":
            raise DataError(f"{where}: an index of token grids (--pool tokens) cannot be searched by image")
        s = settings_of(index)  # the pooling and layer the index's images were embedded with
        similar = cls(index, str(path), s.pool, s.layer, indexed_folder(index.ids, os.getcwd()))
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

    def image_file(self, id: str) -> str:
        """The real path of the indexed image ``id``, checked now: NotServed unless ``id`` is in the index, has no
        ``..`` part, and resolves (links followed) to a regular file inside the indexed folder."""
        try:
            self.index.vector(id)
        except DataError:
            raise NotServed("id not in the index") from None
        if self.root is None or not _is_path(id):
            raise NotServed("no image file of the indexed folder has this id")
        real = os.path.realpath(os.path.join(self.cwd, id))
        root = os.path.realpath(self.root)
        if os.path.commonpath([root, real]) != root or not os.path.isfile(real):
            raise NotServed("no image file of the indexed folder has this id")
        return real

    def thumbnail(self, id: str, decode: Callable[[bytes, int], Image.Image], px: int = THUMBNAIL_PX) -> bytes:
        """A JPEG of the indexed image ``id``, at most ``px`` pixels a side: the file (:meth:`image_file`, read
        with vitkit's size bound) decoded by ``decode`` ((bytes, px) -> an image of about that size, a JPEG decoded
        at reduced scale; its errors pass through), made small and re-encoded."""
        data = read_image_file(self.image_file(id))
        img = convert_image(decode(data, px), "RGB")
        img.thumbnail((px, px), Image.Resampling.BICUBIC)
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=THUMBNAIL_QUALITY)
        return out.getvalue()

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


def _is_path(id: str) -> bool:
    """Whether ``id`` can name an indexed file: not empty, no NUL, no ``..`` part (in either separator)."""
    return bool(id) and "\0" not in id and ".." not in id.replace("\\", "/").split("/")


def indexed_folder(ids: list[str], cwd: str) -> str | None:
    """The deepest folder holding every indexed id that can name a file (absolute, relative ids taken from
    ``cwd``, links not resolved); None when there is none."""
    folders = {os.path.dirname(os.path.normpath(os.path.join(cwd, i))) for i in ids if _is_path(i)}
    if not folders:
        return None
    return os.path.commonpath(sorted(folders))
