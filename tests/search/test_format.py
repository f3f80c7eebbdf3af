"""vitkit's index format: a folder that is not an index, or whose files are truncated, altered, replaced by links
or declare sizes they do not have, is one line and exit 2 -- found before any library parses a file and before
anything is allocated by a declared size."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from search_helpers import clustered, ids

from helpers import run_cli
from vitkit.search import Index, IndexFileError
from vitkit.search import format as fmt


@pytest.fixture
def index_dir(tmp_path: Path) -> Path:
    Index.build(ids(200), clustered(200, 16), {"vitkit.checkpoint": "ab" * 32}).save(tmp_path / "ix")
    return tmp_path / "ix"


def _manifest(folder: Path) -> dict:
    return json.loads((folder / fmt.MANIFEST).read_text())


def _set_manifest(folder: Path, doc: dict) -> None:
    (folder / fmt.MANIFEST).write_text(json.dumps(doc))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(folder: Path, how: str) -> None:
    if how == "flip-vector":
        _flip(folder / fmt.VECTORS, 1234)
    elif how == "flip-ids":
        _flip(folder / fmt.IDS, 10)
    elif how == "truncate-vectors":
        os.truncate(folder / fmt.VECTORS, 4 * 16 * 199)
    elif how == "truncate-manifest":
        os.truncate(folder / fmt.MANIFEST, 50)
    elif how == "grow-vectors":
        with open(folder / fmt.VECTORS, "ab") as f:
            f.write(b"\0" * 64)
    elif how == "planted-file":
        (folder / fmt.MANIFEST).write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(500))
    elif how == "link":
        (folder / fmt.IDS).rename(folder / "elsewhere.json")
        (folder / fmt.IDS).symlink_to(folder / "elsewhere.json")
    elif how == "huge-count":
        doc = _manifest(folder)
        doc["count"] = 1 << 40
        doc["files"][fmt.VECTORS]["bytes"] = (1 << 40) * 16 * 4
        _set_manifest(folder, doc)
    elif how == "other-version":
        doc = _manifest(folder)
        doc["version"] = 99
        _set_manifest(folder, doc)
    elif how == "missing":
        (folder / fmt.VECTORS).unlink()
    elif how == "ids-resized":  # ids.json rewritten with its new checksum but not its count
        (folder / fmt.IDS).write_text(json.dumps(ids(199)))
        doc = _manifest(folder)
        doc["files"][fmt.IDS] = fmt.file_entry(folder / fmt.IDS)
        _set_manifest(folder, doc)


DAMAGE = ["flip-vector", "flip-ids", "truncate-vectors", "truncate-manifest", "grow-vectors", "planted-file",
          "link", "huge-count", "other-version", "missing", "ids-resized"]  # fmt: skip


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_index_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], index_dir: Path, how: str) -> None:
    _damage(index_dir, how)
    with pytest.raises(IndexFileError):
        Index.open(index_dir)
    code, out, err = run_cli(capsys, "search", str(index_dir), "id:img/0000001.jpg")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vitkit search: error: ") and str(index_dir) in err


def test_a_file_or_an_empty_folder_is_not_an_index(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY")
    (tmp_path / "empty").mkdir()
    for p in (tmp_path / "x.npy", tmp_path / "empty", tmp_path / "absent"):
        code, _, err = run_cli(capsys, "dedup", str(p), "--out", str(tmp_path / "g.csv"))
        assert code == 2 and err.count("\n") == 1, err
    assert not (tmp_path / "g.csv").exists()


def test_graph_is_checked_before_hnswlib_reads_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("hnswlib")
    from vitkit.search import ann

    Index.build(ids(300), clustered(300, 16), backend="hnsw").save(tmp_path / "ix")
    _flip(tmp_path / "ix" / fmt.GRAPH, 100)

    def parsed(*a: object, **k: object) -> None:
        raise AssertionError("hnswlib was given a file that fails its checksum")

    monkeypatch.setattr(ann.Graph, "load", parsed)
    with pytest.raises(IndexFileError, match=r"graph\.hnsw fails its checksum"):
        Index.open(tmp_path / "ix")


def test_round_trip_keeps_everything(index_dir: Path) -> None:
    back = Index.open(index_dir)
    doc = _manifest(index_dir)
    assert doc["count"] == 200 and doc["dimension"] == 16 and doc["metric"] == "cosine"
    assert set(doc["files"]) == {fmt.IDS, fmt.VECTORS}
    assert back.ids == ids(200) and back.provenance == {"vitkit.checkpoint": "ab" * 32}
    np.testing.assert_allclose(np.linalg.norm(back.vectors, axis=1), 1.0, atol=1e-6)


def test_save_replaces_only_an_index(tmp_path: Path) -> None:
    from vitkit.errors import VitkitError

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"x")
    index = Index.build(ids(3), clustered(3, 4))
    with pytest.raises(VitkitError):
        index.save(tmp_path / "mine", overwrite=True)
    with pytest.raises(VitkitError):
        index.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "photo.jpg").read_bytes() == b"x"
