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

A row whose image failed (``--skip-bad``) holds NaN in its vector. :mod:`vitkit.outputs.array_reader` reads them back.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import DataError
from vitkit.fileio import WRITER, WRITER_KEY, write_file_atomic
from vitkit.outputs.array_reader import (
    SAFETENSORS_MAX_HEADER,
    ST_DTYPES,
    embeddings_format,
    ids_path,
    read_embeddings,
    safetensors_header,
)
from vitkit.outputs.store import (
    Locked,
    Parts,
    check_same,
    open_regular,
    parquet_marked,
    precheck,
    pyarrow,
    write_parquet,
)
from vitkit.textids import text_id

DTYPES = {"fp32": np.float32, "fp16": np.float16}
_META = "meta.json"


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
            return safetensors_header(path)[0].get("__metadata__", {}).get(WRITER_KEY) == WRITER
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
            yield {k: z[k] for k in _CHUNK_ARRAYS}


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
        errors.update({str(base + j): str(e) for j, e in enumerate(c["error"]) if str(e)})
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


def _assemble_safetensors(path: Path, chunks: list[Path], meta: Mapping[str, str]) -> None:
    n, shape, dtype = _layout(chunks, meta)
    ids, labels, index, errors = _side_doc(chunks)
    vec_bytes = n * math.prod(shape) * np.dtype(dtype).itemsize
    st_name = {np.dtype(t): k for k, t in ST_DTYPES.items()}[np.dtype(dtype)]
    header: dict[str, Any] = {
        "embeddings": {"dtype": st_name, "shape": [n, *shape], "data_offsets": [0, vec_bytes]},
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


def _assemble_parquet(path: Path, chunks: list[Path], meta: Mapping[str, str]) -> None:
    pa = pyarrow()
    _, shape, dtype = _layout(chunks, meta)
    width = max(1, math.prod(shape))
    value = pa.float16() if np.dtype(dtype) == np.float16 else pa.float32()
    schema = pa.schema(
        [
            pa.field("index", pa.int64()),
            pa.field("id", pa.string()),
            pa.field("label", pa.int64()),
            pa.field("embedding", pa.list_(value, width)),
            pa.field("error", pa.string()),
        ],
        metadata={WRITER_KEY: WRITER, **meta, "vitkit.shape": json.dumps(list(shape))},
    )

    def table(c: dict[str, np.ndarray]) -> Any:
        flat = np.ascontiguousarray(c["vector"]).reshape(-1)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=value), width)
        errs = pa.array([str(e) or None for e in c["error"]], type=pa.string())
        columns = [pa.array(c["index"]), pa.array([str(v) for v in c["id"]]), pa.array(c["label"]), emb, errs]
        return pa.Table.from_arrays(columns, schema=schema)

    write_parquet(path, schema, (table(c) for c in _chunks(chunks)))
