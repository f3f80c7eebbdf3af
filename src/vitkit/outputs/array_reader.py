"""Embedding outputs of ``vitkit embed`` read back (:func:`read_embeddings`), whichever of the three formats
:mod:`vitkit.outputs.arrays` wrote them in (the formats are described there). Every size a file declares (a
safetensors header, a tensor's offsets, an ids file) is checked against the file before anything is allocated for
it; ``.npy`` and ``.safetensors`` vectors are memory-mapped."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import DataError
from vitkit.outputs.store import output_suffix, pyarrow

EMBED_FORMATS = (".parquet", ".npy", ".safetensors")
SAFETENSORS_MAX_HEADER = 100_000_000  # the format's own limit
# An ids file (NAME.ids.json beside a .npy output) is read only when it holds at most this many bytes per vector
# (+ 1 MiB): an id, label, index and error message take a few hundred at most, even JSON-escaped
MAX_ID_BYTES = 16 << 10
ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


@dataclass
class Embeddings:
    """Embeddings read back: per row the image's ``id``, ``label`` (-1 without) and position (``index``), the
    ``vectors`` (N, R) or (N, T, D), the ``errors`` of rows whose image failed, and the options they were made
    with (``meta``)."""

    ids: list[str]
    index: np.ndarray  # (N,) int64
    labels: np.ndarray  # (N,) int64
    vectors: np.ndarray  # (N, R) or (N, T, D)
    errors: dict[int, str] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)


def embeddings_format(path: str | os.PathLike[str]) -> str:
    """The format of an embedding output by its suffix (:func:`~vitkit.outputs.store.output_suffix`)."""
    return output_suffix(path, EMBED_FORMATS)


def ids_path(path: Path) -> Path:
    """The ids file beside a ``.npy`` output: ``feats.npy`` -> ``feats.ids.json``."""
    return path.with_name(path.stem + ".ids.json")


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a .safetensors file and where its data starts, checked against the file's size
    before anything is allocated for it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DataError(f"{path}: not a .safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise DataError(f"{path}: not a .safetensors file (a header of {length} bytes in {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise DataError(f"{path}: not a .safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: not a .safetensors file (its header is not a JSON object)")
    return header, 8 + length


def _st_tensor(path: Path, header: Mapping[str, Any], start: int, name: str) -> np.ndarray:
    size = path.stat().st_size
    t = header.get(name)
    if not isinstance(t, dict) or t.get("dtype") not in ST_DTYPES:
        raise DataError(f"{path}: has no {name!r} tensor of a supported type (not written by vitkit embed?)")
    shape, (lo, hi) = [int(s) for s in t["shape"]], [int(o) for o in t["data_offsets"]]
    dtype = np.dtype(ST_DTYPES[t["dtype"]]).newbyteorder("<")
    if min(shape, default=0) < 0 or not 0 <= lo <= hi <= size - start or hi - lo != math.prod(shape) * dtype.itemsize:
        raise DataError(f"{path}: tensor {name!r} does not fit the file (shape {shape}, bytes {lo}..{hi})")
    if hi == lo:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=start + lo, shape=tuple(shape))


def read_embeddings(path: str | os.PathLike[str]) -> Embeddings:
    """An output of ``vitkit embed`` (any of its formats) read back; DataError naming the file when it is not one.
    ``.npy`` and ``.safetensors`` vectors are memory-mapped, not read into memory."""
    p = Path(path)
    fmt = embeddings_format(p)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    try:
        return _read_embeddings(p, fmt)
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # a field of the wrong type or shape
        raise DataError(f"{p}: not readable as vitkit embed's output ({type(e).__name__}: {e})") from None


def _check_ids_size(side: Path, vectors: int) -> None:
    """DataError when an ids file is larger than :data:`MAX_ID_BYTES` per vector (+ 1 MiB), from its size on disk
    before it is read: a sparse 1.5 GB ids file took 3.2 GiB to parse."""
    size, limit = side.stat().st_size, (1 << 20) + vectors * MAX_ID_BYTES
    if size > limit:
        raise DataError(
            f"{side}: {size} bytes for {vectors} vectors, more than the {limit} an ids file of vitkit embed takes "
            f"({MAX_ID_BYTES >> 10} KiB per image + 1 MiB)"
        )


def _read_embeddings(p: Path, fmt: str) -> Embeddings:
    if fmt == ".npy":
        side = ids_path(p)
        if not side.is_file():
            raise DataError(f"{p}: its ids file {side.name} is missing (vitkit embed writes both)")
        try:
            vectors = np.load(p, mmap_mode="r", allow_pickle=False)
            _check_ids_size(side, len(vectors))
            doc = json.loads(side.read_text())
        except ValueError as e:
            raise DataError(f"{p}: not readable as vitkit embed's output ({e})") from None
        ids, labels, index = doc.get("ids"), doc.get("labels"), doc.get("index")
        errors, meta = doc.get("errors", {}), doc.get("meta", {})
    elif fmt == ".safetensors":
        header, start = safetensors_header(p)
        meta = {str(k): str(v) for k, v in header.get("__metadata__", {}).items()}
        vectors = _st_tensor(p, header, start, "embeddings")
        index, labels = _st_tensor(p, header, start, "index").tolist(), _st_tensor(p, header, start, "labels").tolist()
        try:
            ids, errors = json.loads(meta.pop("vitkit.ids")), json.loads(meta.pop("vitkit.errors", "{}"))
        except (KeyError, ValueError):
            raise DataError(f"{p}: no ids in its metadata (vitkit.ids); not written by vitkit embed") from None
    else:
        pyarrow()
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError...
            raise DataError(f"{p}: not a readable Parquet file ({e})") from None
        names = set(table.column_names)
        if not {"id", "embedding"} <= names:
            raise DataError(f"{p}: has no id and embedding columns (not written by vitkit embed)")
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        shape = tuple(json.loads(meta.get("vitkit.shape", "[-1]")))
        emb = table.column("embedding").combine_chunks()
        flat = emb.values.to_numpy(zero_copy_only=False) if len(emb) else np.zeros(0, dtype=np.float32)
        vectors = flat.reshape(len(emb), *shape)
        ids = table.column("id").to_pylist()
        n = len(ids)
        index = table.column("index").to_pylist() if "index" in names else list(range(n))
        labels = table.column("label").to_pylist() if "label" in names else [-1] * n
        errs = table.column("error").to_pylist() if "error" in names else [None] * n
        errors = {str(i): e for i, e in enumerate(errs) if e}
    if not (isinstance(ids, list) and isinstance(labels, list) and isinstance(index, list)):
        raise DataError(f"{p}: its ids, labels or index are missing (not written by vitkit embed)")
    if not len(ids) == len(labels) == len(index) == len(vectors):
        raise DataError(f"{p}: {len(vectors)} vectors but {len(ids)} ids; the file is damaged")
    return Embeddings(
        ids=[str(i) for i in ids],
        index=np.asarray(index, dtype=np.int64),
        labels=np.asarray(labels, dtype=np.int64),
        vectors=vectors,
        errors={int(k): str(v) for k, v in dict(errors).items()},
        meta=dict(meta),
    )
