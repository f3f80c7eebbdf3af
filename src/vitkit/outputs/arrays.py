"""Embedding outputs of ``vitkit embed``: one vector (or token grid) per image with its id, label and position,
in Parquet, ``.npy`` or ``.safetensors`` (by the file's suffix), written batch by batch and resumable after a kill.

None of the three formats can be appended to in place (a Parquet footer, the ``.npy`` header's shape and the
``.safetensors`` header all describe the whole file), so :class:`EmbeddingWriter` writes each batch as a chunk
file ``NAME.parts/part-NNNNNNNN.npz`` (written under a temporary name and renamed: a kill never leaves a chunk
half-written) and assembles the final file from the chunks on :meth:`~EmbeddingWriter.close`, in bounded memory
(chunk by chunk), after which the chunk folder is removed. ``resume`` continues from the chunks there.

The formats (``N`` rows; ``R`` the vector width, or ``T x D`` tokens with ``--pool tokens``):

- ``.parquet``: columns ``index`` (the image's position in the input), ``id`` (path, shard member, dataset row),
  ``label`` (-1 without labels), ``embedding`` (a fixed-size list of float32 or float16 of ``R`` or ``T*D``
  values), and with ``--skip-bad`` ``error``; the shape of one embedding in the schema metadata
  (``vitkit.shape``, JSON), with the options it was made with;
- ``.npy``: the array (N, R) or (N, T, D) as ``numpy.load`` reads it, and beside it ``NAME.ids.json``: a JSON
  object with ``ids``, ``labels``, ``index`` (lists in row order), ``errors`` (row -> reason) and ``meta``;
- ``.safetensors``: tensors ``embeddings`` (N, R) or (N, T, D), ``index`` and ``labels`` (int64), and in the
  header's ``__metadata__`` the ids (``vitkit.ids``, a JSON list), errors and options. The format caps its
  header at 100 MB, which holds ids of a million or so images; use Parquet for more.

A row whose image failed (``--skip-bad``) holds NaN in its vector.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import DataError
from vitkit.fileio import WRITER, WRITER_KEY, write_file_atomic
from vitkit.outputs.store import (
    Locked,
    Parts,
    check_same,
    open_regular,
    output_suffix,
    parquet_marked,
    precheck,
    pyarrow,
    write_parquet,
)
from vitkit.textids import text_id

EMBED_FORMATS = (".parquet", ".npy", ".safetensors")
DTYPES = {"fp32": np.float32, "fp16": np.float16}
_META = "meta.json"
SAFETENSORS_MAX_HEADER = 100_000_000  # the format's own limit
# An ids file (NAME.ids.json beside a .npy output) is read only when it holds at most this many bytes per vector
# (+ 1 MiB): an id, label, index and error message take a few hundred at most, even JSON-escaped
MAX_ID_BYTES = 16 << 10
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


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


def _parts(path: Path) -> Parts:
    return Parts.beside(path, ".npz", extra=[_META])


def _is_ours(path: Path) -> bool:
    """Whether an existing output file was written by vitkit (its writer mark)."""
    try:
        suffix = path.suffix.lower()
        if suffix == ".npy":
            side = ids_path(path)
            return side.is_file() and json.loads(side.read_text()).get(WRITER_KEY) == WRITER
        if suffix == ".safetensors":
            return _safetensors_header(path)[0].get("__metadata__", {}).get(WRITER_KEY) == WRITER
        return parquet_marked(path)
    except Exception:  # unreadable: not something vitkit finished writing
        return False


def check_embeddings_output(path: Path, *, resume: bool, overwrite: bool) -> None:
    """May ``path`` be written as an embedding output? New: yes. Existing (with its ids file or chunk folder):
    only with ``resume`` or ``overwrite``, and only what vitkit wrote; a folder never."""
    sides = [ids_path(path)] if embeddings_format(path) == ".npy" else []
    parts = _parts(path)
    precheck(path, parts, formats=".parquet, .npy or .safetensors", resume=resume, overwrite=overwrite, sides=sides,
             ours=None if parts.folder.exists() else _is_ours)  # fmt: skip


class EmbeddingWriter(Locked):
    """An embedding output being written (see the module docstring). ``meta``: the options the vectors are made
    with (strings), stored in the output; a resumed output must have been started with the same. ``done`` and
    ``ids``: rows complete (as found when opened, then counting what was written)."""

    def __init__(
        self, path: str | os.PathLike[str], meta: Mapping[str, str], *, resume: bool = False, overwrite: bool = False
    ) -> None:
        self.path = Path(path)
        embeddings_format(self.path)
        Locked.locked(self.path, lambda: self._open(meta, resume, overwrite))  # held until close: one job per output

    def _open(self, meta: Mapping[str, str], resume: bool, overwrite: bool) -> EmbeddingWriter:
        check_embeddings_output(self.path, resume=resume, overwrite=overwrite)
        self.format = embeddings_format(self.path)
        self.meta = dict(meta)
        self.parts = _parts(self.path)
        self.ids: list[str] = []
        self.next_part = 0
        self.finished = False  # resumed from a finished output: nothing to assemble unless more is written
        if not resume:
            self._remove_earlier()
        elif self.parts.folder.is_dir():
            self._reopen()
        elif self.path.exists():
            ids, found = _finished_ids(self.path)  # the ids and options alone: never the vectors
            self._check_meta(found, self.path)
            self.ids, self.finished = ids, True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.finished and not self.parts.folder.is_dir():
            self.parts.folder.mkdir()
            self._write_meta()
        return self

    @property
    def done(self) -> int:
        return len(self.ids)

    def _write_meta(self) -> None:
        write_file_atomic(self.parts.folder / _META, lambda tmp: tmp.write_text(json.dumps(self.meta)))

    def _remove_earlier(self) -> None:
        self.parts.discard()
        for p in (self.path, ids_path(self.path) if self.format == ".npy" else None):
            if p is not None and p.exists():
                p.unlink()

    def _check_meta(self, found: Mapping[str, str], where: Path) -> None:
        ours = {k: v for k, v in found.items() if k.startswith("vitkit.embed.")}
        if ours != {k: v for k, v in self.meta.items() if k.startswith("vitkit.embed.")}:
            raise DataError(
                f"{where}: was started with other options ({json.dumps(ours)}); continue it with those, or write to "
                "a new --out"
            )
        check_same(found, self.meta, str(where))  # the checkpoint, precision, preprocessing and input

    def _reopen(self) -> None:
        self.parts.drop_temporaries()  # a chunk cut mid-write (never renamed into place)
        meta = self.parts.folder / _META
        if meta.is_file():
            self._check_meta(_read_meta(meta), self.parts.folder)
        else:
            self._write_meta()
        found = [(number, part, _chunk_ids(part)) for number, part in self.parts.numbered()]
        while found and isinstance(found[-1][2], str):  # the last chunks, damaged (a power cut): written again
            found.pop()[1].unlink()
        for number, part, ids in found:
            if isinstance(ids, str):
                raise DataError(
                    f"{part}: a damaged chunk ({ids}) before complete ones; vitkit resumes only undamaged outputs "
                    "(pass --overwrite to start again, or write to a new --out)"
                )
            self.ids += ids
            self.next_part = number + 1

    def write(self, columns: Mapping[str, Any]) -> None:
        """One batch: ``index``, ``id``, ``label``, ``vector`` (B, ...) and optionally ``error`` (""; a reason).
        Complete on disk (a chunk file) when this returns."""
        ids = [text_id(str(v)) for v in columns["id"]]
        if not ids:
            return
        if self.finished:
            raise DataError(f"--out {self.path}: is finished; pass --overwrite to start it again")
        vectors = np.asarray(columns["vector"])
        errors = [text_id(str(e)) for e in (columns.get("error") or [""] * len(ids))]
        self.parts.write(self.next_part, lambda f: np.savez(
            f, index=np.asarray(columns["index"], dtype=np.int64), id=np.asarray(ids, dtype=str),
            label=np.asarray(columns["label"], dtype=np.int64), vector=vectors, error=np.asarray(errors, dtype=str),
        ))  # fmt: skip
        self.next_part += 1
        self.ids += ids

    def _finish(self) -> None:
        """Assemble the chunks into the output file (and its ids file), then remove the chunk folder."""
        if self.finished or not self.parts.folder.is_dir():
            return
        chunks = [p for _, p in self.parts.numbered()]
        assemble = {".parquet": _assemble_parquet, ".npy": _assemble_npy, ".safetensors": _assemble_safetensors}
        assemble[self.format](self.path, chunks, self.meta)
        self.parts.discard()


def _read_meta(path: Path) -> dict[str, str]:
    """A chunk folder's ``meta.json`` (DataError naming it when it is not a JSON object of strings)."""
    with open_regular(path, write=False) as f:
        data = f.read(1 << 20)
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
        raise DataError(f"{path}: not the options file vitkit embed writes; write to a new --out")
    return doc


_CHUNK_ARRAYS = ("index", "id", "label", "vector", "error")


def _chunk_ids(part: Path) -> list[str] | str:
    """The ids of a chunk file, once it is checked whole (every array there, each the size its header declares,
    all of one length, every CRC right); else why it is damaged (an empty or cut file: what a power cut leaves of
    a chunk not yet on disk). Only the ids are read."""
    try:
        with np.load(part, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile) or sorted(z.files) != sorted(_CHUNK_ARRAYS):
                return "not the arrays of a chunk"
            rows = {_npz_rows(z, name) for name in _CHUNK_ARRAYS}
            if len(rows) != 1 or z.zip is None or z.zip.testzip() is not None:
                return "arrays of different lengths" if len(rows) != 1 else "a checksum does not match"
            return [str(v) for v in z["id"]]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _npz_rows(z: Any, name: str) -> int:
    """Rows of the array ``name`` of an ``.npz`` from its header, checked against the member's size (ValueError)."""
    info = z.zip.getinfo(name + ".npy")
    with z.zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
        if info.file_size != f.tell() + math.prod(shape) * dtype.itemsize or not shape:
            raise ValueError(f"{name}: {info.file_size} bytes, not what its header declares")
    return int(shape[0])


def _finished_ids(path: Path) -> tuple[list[str], dict[str, str]]:
    """(ids, options) of a finished embedding output, without reading its vectors (Parquet: the id column
    alone, streamed; .npy: the ids file; .safetensors: the header)."""
    if path.suffix.lower() != ".parquet":
        e = read_embeddings(path)  # .npy and .safetensors vectors are memory-mapped, not read
        return e.ids, e.meta
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        meta = {k.decode(): v.decode() for k, v in (pf.schema_arrow.metadata or {}).items()}
        ids = [str(v) for b in pf.iter_batches(columns=["id"]) for v in b.column(0).to_pylist()]
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, KeyError...
        raise DataError(f"{path}: not a readable Parquet file of vitkit embed ({e})") from None
    return ids, meta


def _chunks(chunks: list[Path]) -> Iterator[dict[str, np.ndarray]]:
    for c in chunks:
        with np.load(c, allow_pickle=False) as z:
            yield {k: z[k] for k in ("index", "id", "label", "vector", "error")}


def _layout(chunks: list[Path], meta: Mapping[str, str]) -> tuple[int, tuple[int, ...], np.dtype]:
    """(rows, shape of one vector, dtype) of the chunks (without reading their vectors)."""
    n, shape, dtype = 0, None, None
    for c in chunks:
        with np.load(c, allow_pickle=False, mmap_mode="r") as z:
            v = z["vector"]
            n += v.shape[0]
            shape, dtype = v.shape[1:], v.dtype
    if shape is None:  # no rows at all
        return 0, tuple(json.loads(meta.get("vitkit.embed.shape", "[0]"))), np.dtype(np.float32)
    assert dtype is not None
    return n, tuple(shape), dtype


def _side_doc(chunks: list[Path]) -> tuple[list[str], list[int], list[int], dict[str, str]]:
    ids: list[str] = []
    labels: list[int] = []
    index: list[int] = []
    errors: dict[str, str] = {}
    for c in _chunks(chunks):
        base = len(ids)
        for j, e in enumerate(c["error"]):
            if str(e):
                errors[str(base + j)] = str(e)
        ids += [str(v) for v in c["id"]]
        labels += c["label"].tolist()
        index += c["index"].tolist()
    return ids, labels, index, errors


def _assemble_npy(path: Path, chunks: list[Path], meta: Mapping[str, str]) -> None:
    n, shape, dtype = _layout(chunks, meta)

    def write(tmp: Path) -> None:  # the array, then its ids file: both in place before the array is renamed
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n, *shape))
        row = 0
        for c in _chunks(chunks):
            arr[row : row + len(c["vector"])] = c["vector"]
            row += len(c["vector"])
        arr.flush()
        del arr
        ids, labels, index, errors = _side_doc(chunks)
        doc = {WRITER_KEY: WRITER, "ids": ids, "labels": labels, "index": index, "errors": errors, "meta": dict(meta)}
        write_file_atomic(ids_path(path), lambda side: side.write_text(json.dumps(doc)))

    write_file_atomic(path, write)


def _st_dtype(dtype: np.dtype) -> str:
    return {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}[np.dtype(dtype)]


def _assemble_safetensors(path: Path, chunks: list[Path], meta: Mapping[str, str]) -> None:
    n, shape, dtype = _layout(chunks, meta)
    ids, labels, index, errors = _side_doc(chunks)
    vec_bytes = n * math.prod(shape) * np.dtype(dtype).itemsize
    header: dict[str, Any] = {
        "embeddings": {"dtype": _st_dtype(dtype), "shape": [n, *shape], "data_offsets": [0, vec_bytes]},
        "index": {"dtype": "I64", "shape": [n], "data_offsets": [vec_bytes, vec_bytes + 8 * n]},
        "labels": {"dtype": "I64", "shape": [n], "data_offsets": [vec_bytes + 8 * n, vec_bytes + 16 * n]},
        "__metadata__": {
            WRITER_KEY: WRITER, **meta, "vitkit.ids": json.dumps(ids), "vitkit.errors": json.dumps(errors)
        },
    }  # fmt: skip
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    if len(text) > SAFETENSORS_MAX_HEADER:
        raise DataError(
            f"--out {path}: the ids of {n} images do not fit a .safetensors header (100 MB at most); use .parquet"
        )

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for c in _chunks(chunks):
                f.write(np.ascontiguousarray(c["vector"], dtype=dtype).astype(dtype.newbyteorder("<")).tobytes())
            f.write(np.asarray(index, dtype="<i8").tobytes())
            f.write(np.asarray(labels, dtype="<i8").tobytes())

    write_file_atomic(path, write)


def _parquet_schema(pa: Any, width: int, dtype: np.dtype, meta: Mapping[str, str], shape: tuple[int, ...]) -> Any:
    value = pa.float16() if np.dtype(dtype) == np.float16 else pa.float32()
    return pa.schema(
        [
            pa.field("index", pa.int64()),
            pa.field("id", pa.string()),
            pa.field("label", pa.int64()),
            pa.field("embedding", pa.list_(value, width)),
            pa.field("error", pa.string()),
        ],
        metadata={WRITER_KEY: WRITER, **meta, "vitkit.shape": json.dumps(list(shape))},
    )


def _assemble_parquet(path: Path, chunks: list[Path], meta: Mapping[str, str]) -> None:
    pa = pyarrow()
    _, shape, dtype = _layout(chunks, meta)
    width = max(1, math.prod(shape))
    schema = _parquet_schema(pa, width, dtype, meta, shape)

    def table(c: dict[str, np.ndarray]) -> Any:
        flat = np.ascontiguousarray(c["vector"]).reshape(-1)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=schema.field("embedding").type.value_type), width)
        errs = pa.array([str(e) or None for e in c["error"]], type=pa.string())
        columns = [pa.array(c["index"]), pa.array([str(v) for v in c["id"]]), pa.array(c["label"]), emb, errs]
        return pa.Table.from_arrays(columns, schema=schema)

    write_parquet(path, schema, (table(c) for c in _chunks(chunks)))


# ---- reading ----------------------------------------------------------------------------------------------


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
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
    if not isinstance(t, dict) or t.get("dtype") not in _ST_DTYPES:
        raise DataError(f"{path}: has no {name!r} tensor of a supported type (not written by vitkit embed?)")
    shape, (lo, hi) = [int(s) for s in t["shape"]], [int(o) for o in t["data_offsets"]]
    dtype = np.dtype(_ST_DTYPES[t["dtype"]]).newbyteorder("<")
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
        header, start = _safetensors_header(p)
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
