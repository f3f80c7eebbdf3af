"""vitkit's index format: a folder that holds

- ``manifest.json``: ``format`` ("vitkit-index"), ``version`` (1), ``dimension``, ``count``, ``metric``
  ("cosine"), ``backend`` (``{"name": "exact"}`` or the approximate library with its version and parameters),
  ``provenance`` (what the vectors were made from: checkpoint digest, layer, pooling, precision, normalisation,
  preprocessing -- the ``vitkit.*`` keys of ``vitkit embed``'s outputs) and ``files``: for every data file its
  size in bytes and SHA-256;
- ``ids.json``: the ids (image paths, dataset rows) in row order, a JSON list of strings;
- ``vectors.f32``: the L2-normalised vectors, ``count`` x ``dimension`` little-endian float32, row-major, no header;
- the approximate backend's own file: ``graph.hnsw`` (hnswlib's graph) or ``lists.ivf`` (vitkit's k-means lists:
  centres, list offsets, rows and a copy of the vectors in list order; raw little-endian, sizes from the manifest).

Reading (:func:`verify`) checks, before any library parses anything and before anything is allocated by a declared
size: the manifest (a regular file of at most 1 MiB, every field of its type and range), that each data file is
a regular file (not a link) of exactly its recorded size (the vectors' size must be ``count * dimension * 4``),
and then the SHA-256 of each, streamed in 1 MiB blocks. A folder that is not an index, or fails any check, is
one :class:`IndexFileError` line naming the folder and the file.

Writing goes through :func:`vitkit.fileio.write_dir_atomic`: a new folder is written beside the index and swapped
in by renames, so a kill at any point leaves the old index or the new one (:func:`vitkit.fileio.complete_dir`
finds the old one set aside between the two renames), never a mixture.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitkit.errors import DataError
from vitkit.hub.download import sha256_file

FORMAT = "vitkit-index"
VERSION = 1
MANIFEST = "manifest.json"
IDS = "ids.json"
VECTORS = "vectors.f32"
GRAPH = "graph.hnsw"
LISTS = "lists.ivf"
MANIFEST_MAX_BYTES = 1 << 20
MAX_ID_BYTES = 16 << 10  # per id in ids.json (+ 1 MiB), as for vitkit embed's ids files
MAX_DIMENSION = 1 << 16
# the HNSW graph: at most this many bytes per vector beyond the vector itself (links of every level, label, lock)
GRAPH_BYTES_PER_ROW = 4096


class IndexFileError(DataError, ValueError):
    """A folder that is not a vitkit index, or one whose files fail their checks (sizes, checksums): one line."""


def file_entry(path: Path) -> dict[str, Any]:
    """A data file's manifest entry: its size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def expected_files(backend: Mapping[str, Any]) -> set[str]:
    """The data files an index of ``backend`` holds (the manifest lists exactly these)."""
    name = backend.get("name")
    return {IDS, VECTORS} | ({LISTS} if name == "ivf" else {GRAPH} if name != "exact" else set())


def _int(doc: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = doc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise IndexFileError(f"{where}: {key} is {v!r}, not a whole number in {lo}..{hi}")
    return v


def _regular_size(path: Path, where: str) -> int:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise IndexFileError(f"{where}: {path.name} is missing; not a complete vitkit index") from None
    if not stat.S_ISREG(st.st_mode):
        raise IndexFileError(f"{where}: {path.name} is not a regular file (a link, folder or device); refused")
    return st.st_size


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the index at ``folder``, its fields checked (not yet the data files)."""
    where = str(folder)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise IndexFileError(f"{where}: no such index") from None
    if not stat.S_ISDIR(st.st_mode):
        raise IndexFileError(f"{where}: not a vitkit index (an index is a folder with {MANIFEST})")
    path = folder / MANIFEST
    size = _regular_size(path, where)
    if size > MANIFEST_MAX_BYTES:
        raise IndexFileError(f"{where}: {MANIFEST} is {size} bytes, more than a vitkit index's manifest holds")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MANIFEST_MAX_BYTES + 1))
    except (ValueError, UnicodeDecodeError):
        raise IndexFileError(f"{where}: {MANIFEST} is not JSON; not a vitkit index") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IndexFileError(f"{where}: {MANIFEST} is not a vitkit index's manifest")
    if doc.get("version") != VERSION:
        raise IndexFileError(f"{where}: index format version {doc.get('version')!r}; this vitkit reads {VERSION}")
    dim = _int(doc, "dimension", 1, MAX_DIMENSION, where)
    _int(doc, "count", 0, (1 << 62) // (4 * dim), where)
    if doc.get("metric") != "cosine":
        raise IndexFileError(f"{where}: metric {doc.get('metric')!r}; vitkit indexes are cosine")
    backend, prov, files = doc.get("backend"), doc.get("provenance"), doc.get("files")
    if not isinstance(backend, dict) or not isinstance(backend.get("name"), str):
        raise IndexFileError(f"{where}: {MANIFEST} has no backend name")
    if not isinstance(prov, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prov.items()):
        raise IndexFileError(f"{where}: {MANIFEST}'s provenance is not an object of strings")
    if not isinstance(files, dict) or set(files) != expected_files(backend):
        raise IndexFileError(f"{where}: {MANIFEST} lists files {sorted(files or [])!r}, not those of its backend")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64:
            raise IndexFileError(f"{where}: {MANIFEST} has no SHA-256 for {name}")
        _int(entry, "bytes", 0, 1 << 62, f"{where}: {name}")
    return doc


def verify(folder: Path) -> dict[str, Any]:
    """The manifest of the index at ``folder`` once every data file has its recorded size (and the sizes fit
    ``count`` and ``dimension``) and its recorded SHA-256; :class:`IndexFileError` otherwise. Nothing is parsed
    or allocated by a declared size before these checks pass."""
    doc = read_manifest(folder)
    where, count, dim = str(folder), doc["count"], doc["dimension"]
    limits = {
        VECTORS: (count * dim * 4, count * dim * 4),
        IDS: (2, (1 << 20) + count * MAX_ID_BYTES),
        GRAPH: (0, (1 << 20) + count * (dim * 4 + GRAPH_BYTES_PER_ROW)),
        LISTS: (0, (count + 1) * (2 * dim * 4 + 16)),  # centres (at most count), offsets, rows, vectors
    }
    for name, entry in doc["files"].items():
        lo, hi = limits[name]
        if not lo <= entry["bytes"] <= hi:
            raise IndexFileError(f"{where}: {MANIFEST} records {entry['bytes']} bytes for {name}, which does not fit "
                                 f"{count} vectors of dimension {dim}")  # fmt: skip
        size = _regular_size(folder / name, where)
        if size != entry["bytes"]:
            raise IndexFileError(f"{where}: {name} is {size} bytes, the manifest records {entry['bytes']} (truncated "
                                 "or replaced); rebuild the index")  # fmt: skip
    for name, entry in doc["files"].items():
        if sha256_file(folder / name) != entry["sha256"]:
            raise IndexFileError(f"{where}: {name} fails its checksum (SHA-256 differs from the manifest's); "
                                 "rebuild the index")  # fmt: skip
    return doc


def read_ids(folder: Path, count: int) -> list[str]:
    """The ids of a verified index: a JSON list of ``count`` distinct strings."""
    try:
        ids = json.loads((folder / IDS).read_bytes())
    except (ValueError, UnicodeDecodeError):
        ids = None
    if not isinstance(ids, list) or len(ids) != count or not all(isinstance(i, str) for i in ids):
        raise IndexFileError(f"{folder}: {IDS} is not a list of {count} ids")
    if len(set(ids)) != len(ids):
        raise IndexFileError(f"{folder}: {IDS} repeats an id")
    return ids


def manifest_doc(
    *, dimension: int, count: int, backend: Mapping[str, Any], provenance: Mapping[str, str], folder: Path
) -> dict[str, Any]:
    """The manifest of the data files just written in ``folder`` (their sizes and checksums computed here)."""
    files = {name: file_entry(folder / name) for name in sorted(expected_files(backend))}
    return {
        "format": FORMAT,
        "version": VERSION,
        "dimension": dimension,
        "count": count,
        "metric": "cosine",
        "backend": dict(backend),
        "provenance": dict(provenance),
        "files": files,
    }
