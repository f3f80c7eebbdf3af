"""The one chunk store under every resumable output (issue 33): resume after a kill, tested once for every format
(rows: JSONL, CSV, Parquet; arrays: Parquet, .npy, .safetensors; the feature cache's chunks), its metadata check,
its pre-check and that it deletes only its own files."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vitkit import fileio
from vitkit.errors import ConfigError, DataError
from vitkit.outputs.array_reader import read_embeddings
from vitkit.outputs.arrays import EmbeddingWriter
from vitkit.outputs.rows import Field, check_rows_output, open_rows
from vitkit.outputs.store import Parts

FORMATS = ["rows.jsonl", "rows.csv", "rows.parquet", "arrays.parquet", "arrays.npy", "arrays.safetensors"]
META = {"vitkit.checkpoint": "a" * 64, "vitkit.precision": "fp32"}
BATCHES = [[f"img{b}{i}" for i in range(3)] for b in range(4)]  # four batches of three ids


def _open(kind: str, out: Path, resume: bool = False, meta: dict[str, str] = META) -> Any:
    if kind.startswith("rows"):
        fields = [Field("image", "str"), Field("score", "float"), Field("top", "int_list", width=2)]
        return open_rows(out, fields, id_field="image", resume=resume, meta=meta)
    return EmbeddingWriter(out, meta, resume=resume)


def _batch(kind: str, b: int) -> dict[str, Any]:
    ids = BATCHES[b]
    score = np.arange(3, dtype=np.float32) + 10 * b
    if kind.startswith("rows"):
        return {"image": ids, "score": score, "top": np.stack([score, score + 1]).T.astype(int)}
    return {"index": np.arange(3) + 3 * b, "id": ids, "label": np.full(3, b), "vector": np.stack([score, -score]).T}


def _read(kind: str, out: Path) -> list[tuple[Any, ...]]:
    """The rows of a finished output as (id, values...), whatever its format."""
    if kind == "rows.jsonl":
        return [(r["image"], r["score"], r["top"]) for r in map(json.loads, out.read_text().splitlines())]
    if kind == "rows.csv":
        return [(r["image"], float(r["score"]), [int(r["top_1"]), int(r["top_2"])])
                for r in csv.DictReader(out.open())]  # fmt: skip
    if kind == "rows.parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(out).to_pydict()
        return list(zip(t["image"], t["score"], t["top"], strict=True))
    e = read_embeddings(out)
    return [(i, int(x), int(y), v.tolist()) for i, x, y, v in zip(e.ids, e.index, e.labels, e.vectors, strict=True)]


def _kill(kind: str, out: Path, writer: Any) -> None:
    """What a SIGKILL mid-batch leaves: the lock gone with the process, and the next batch cut mid-write (a row
    without its newline, or a chunk under its temporary name)."""
    writer.release()
    if kind in ("rows.jsonl", "rows.csv"):
        with out.open("ab") as f:
            f.write(b'{"image": "img2' if kind == "rows.jsonl" else b"img20,2")
    else:
        parts = out.with_name(out.name + ".parts")
        (parts / f".part-00000002.{'parquet' if kind == 'rows.parquet' else 'npz'}.tmp").write_bytes(b"PAR1 cut")


@pytest.mark.parametrize("kind", FORMATS)
def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path: Path, kind: str) -> None:
    suffix = "." + kind.split(".")[1]
    whole = tmp_path / f"whole{suffix}"
    w = _open(kind, whole)
    for b in range(4):
        w.write(_batch(kind, b))
    w.close()

    out = tmp_path / f"cut{suffix}"
    w = _open(kind, out)
    w.write(_batch(kind, 0))
    w.write(_batch(kind, 1))
    _kill(kind, out, w)
    with pytest.raises(DataError, match="checkpoint"):  # the metadata check: another checkpoint's rows never join
        _open(kind, out, resume=True, meta={**META, "vitkit.checkpoint": "b" * 64})
    w = _open(kind, out, resume=True)
    assert w.done == 6 and w.ids == BATCHES[0] + BATCHES[1]
    w.write(_batch(kind, 2))
    w.write(_batch(kind, 3))
    w.close()
    assert _read(kind, out) == _read(kind, whole)
    assert not out.with_name(out.name + ".parts").exists()
    again = _open(kind, out, resume=True)  # a finished output resumed: every row is there already
    assert again.ids == [i for b in BATCHES for i in b]
    again.close()
    assert _read(kind, out) == _read(kind, whole)


@pytest.mark.parametrize("kind", FORMATS)
def test_the_pre_check_refuses_an_existing_output_and_foreign_files(tmp_path: Path, kind: str) -> None:
    out = tmp_path / f"o.{kind.split('.')[1]}"
    w = _open(kind, out)
    w.write(_batch(kind, 0))
    w.release()  # killed: the parts folder (or the file) stays
    with pytest.raises(ConfigError, match="--resume"):
        _open(kind, out)
    parts = out.with_name(out.name + ".parts")
    parts.mkdir(exist_ok=True)
    (parts / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt"):
        _open(kind, out, resume=True)
    assert (parts / "notes.txt").read_text() == "mine"


def test_the_feature_cache_chunks_are_parts_of_the_store(tmp_path: Path) -> None:
    """The feature cache's layout (``chunk-NNNNNN.safetensors`` beside ``key.json``) is a store: chunks written by
    rename replace a damaged one, and clearing removes only the store's own files."""
    chunks = Parts(tmp_path, ".safetensors", prefix="chunk-", digits=6, extra=["key.json"])
    assert chunks.path(3).name == "chunk-000003.safetensors"
    chunks.path(0).write_bytes(b"damaged")
    chunks.write(0, lambda f: f.write(b"good"))
    chunks.write(1, lambda f: f.write(b"more"))
    (tmp_path / ".chunk-000002.safetensors.tmp-0123abcd").write_bytes(b"cut")  # an earlier version's temporary
    cut = fileio.temp_path(chunks.path(2))
    cut.mkdir()  # write_file_atomic's private folder, a kill mid-write
    (cut / chunks.path(2).name).write_bytes(b"cut")
    (tmp_path / "key.json").write_text("{}")
    (tmp_path / "chunk-mine.safetensors").write_text("not a chunk name")
    assert chunks.path(0).read_bytes() == b"good" and [n for n, _ in chunks.numbered()] == [0, 1]
    assert chunks.foreign() == "chunk-mine.safetensors"
    chunks.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-mine.safetensors", "key.json"]


def test_two_writers_of_one_chunk_never_share_a_temporary_file(tmp_path: Path) -> None:
    """Two runs filling one feature cache may compute the same chunk at once: each writes under a name of its own,
    so neither removes or renames the other's half-written file (the last complete one wins), and starting the
    folder anew keeps a chunk another run is writing."""
    chunks = Parts(tmp_path, ".safetensors", prefix="chunk-", digits=6, extra=["key.json"])

    def first(f: Any) -> None:
        f.write(b"first, ")
        chunks.write(0, lambda g: g.write(b"second"))  # the other run, meanwhile, from start to rename
        chunks.clear(temporary=False)  # and a third one starting the folder anew
        f.write(b"complete")

    chunks.write(0, first)
    assert chunks.path(0).read_bytes() == b"first, complete"
    assert [p.name for p in tmp_path.iterdir()] == ["chunk-000000.safetensors"]


def test_discard_deletes_only_the_stores_own_files(tmp_path: Path) -> None:
    parts = Parts.beside(tmp_path / "o.parquet", ".parquet")
    parts.write(0, lambda f: f.write(b"x"))
    (parts.folder / "keep.txt").write_text("a user's file, put there since the pre-check")
    parts.discard()
    assert not parts.folder.exists()
    (aside,) = tmp_path.iterdir()  # renamed aside, its own files gone, the stranger kept
    assert [p.name for p in aside.iterdir()] == ["keep.txt"]


def test_a_parquet_row_output_without_pyarrow_is_refused_by_the_pre_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The duplicate pre-checks differed: embed refused .parquet without pyarrow before any work, predict only
    when it opened the output, after the model was loaded. The one pre-check refuses both up front."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(ConfigError, match="needs pyarrow"):
        check_rows_output(tmp_path / "p.parquet", resume=False, overwrite=False)
    check_rows_output(tmp_path / "p.jsonl", resume=False, overwrite=False)
