"""A crash in the middle of a write leaves the file that was there before as it was, for every writer that puts
a file in place: each goes through fileio's one write-then-rename (``write_file_atomic``, or ``publish`` for a
file finished elsewhere), none renames on its own. The crash is a write that dies after some bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from vitkit import fileio, native
from vitkit.errors import VitkitError
from vitkit.train import logs

SOURCE = "int vk_twice(int a) { return 2 * a; }\n"


def _dies_after(n: int) -> Any:
    """A write of bytes to a path that writes the first ``n`` bytes and then fails as a full disk does."""

    def write(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data[:n])
        raise OSError(28, "No space left on device")

    return write


def _only(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_runs_config_json_survives_a_crash_mid_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs.write_config(tmp_path, {"name": "first", "optim": {"lr": 0.01}})
    before = (tmp_path / "config.json").read_bytes()
    real = Path.write_bytes
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: _dies_after(7)(self, data))
    with pytest.raises(VitkitError, match=r"config\.json: cannot write"):
        logs.write_config(tmp_path, {"name": "second", "optim": {"lr": 0.03}})
    monkeypatch.setattr(Path, "write_bytes", real)
    assert (tmp_path / "config.json").read_bytes() == before
    assert json.loads(before)["name"] == "first"
    assert _only(tmp_path) == ["config.json"]  # no temporary left beside it


def test_a_finished_parquet_output_survives_a_crash_while_it_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    from vitkit.outputs import rows

    fields = [rows.Field("id", "str"), rows.Field("score", "float")]
    out = tmp_path / "out.parquet"
    w = rows.open_rows(out, fields, id_field="id")
    w.write({"id": ["a", "b", "c"], "score": [0.5, 0.25, 0.125]})
    w.close()
    before = out.read_bytes()

    def copy_dies(src: Any, dst: Any, length: int = 0) -> None:
        dst.write(src.read(100))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", copy_dies)
    with pytest.raises(VitkitError, match="cannot write"):
        rows.open_rows(out, fields, id_field="id", resume=True)
    monkeypatch.undo()
    assert out.read_bytes() == before  # the finished file as it was, and no half part beside it
    assert rows.Parts.beside(out, ".parquet").numbered() == []

    w = rows.open_rows(out, fields, id_field="id", resume=True)  # the crash cost nothing: all three rows are there
    assert w.ids == ["a", "b", "c"]
    w.write({"id": ["d"], "score": [1.0]})
    w.close()
    assert pq.read_table(out).column("id").to_pylist() == ["a", "b", "c", "d"]


def test_a_published_file_leaves_the_old_one_when_the_flush_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``publish`` (a download's partial file, a sweep's winning run's files) renames only a flushed file."""
    old, new = tmp_path / "model.npz", tmp_path / ".partial"
    old.write_bytes(b"the old weights")
    new.write_bytes(b"the new wei")  # the transfer was cut here
    real = os.fsync

    def fsync_fails(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fileio.os, "fsync", fsync_fails)
    with pytest.raises(OSError):
        fileio.publish(new, old)
    monkeypatch.setattr(fileio.os, "fsync", real)
    assert old.read_bytes() == b"the old weights" and new.exists()
    fileio.publish(new, old)
    assert old.read_bytes() == b"the new wei" and not new.exists()


@pytest.mark.skipif(native.compiler() is None, reason="needs a C compiler")
def test_a_native_library_copied_in_part_is_not_left_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))

    def copy_dies(src: Any, dst: Any) -> None:
        _dies_after(64)(Path(dst), Path(src).read_bytes())

    monkeypatch.setattr(native.shutil, "copyfile", copy_dies)
    assert native.build(SOURCE, "vk_twice") is None  # reported, and the pure-PyTorch path is taken
    folder = tmp_path / "home" / "native"
    assert _only(folder) == []  # neither a cut library under its name nor a temporary
    monkeypatch.undo()
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    lib = native.load(SOURCE, "vk_twice")
    assert lib is not None and lib.vk_twice(21) == 42
