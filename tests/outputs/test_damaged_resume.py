"""A damaged output met by ``--resume`` (issue 47, item 11): an empty or cut embedding chunk (what a power cut
leaves of a chunk renamed before it reached the disk) is written again when it is the last, refused in one line
naming it when complete chunks follow -- never an EOFError or BadZipFile traceback; every chunk is flushed to disk
before its rename; and one stray ``"`` in a CSV output is refused naming its line, where it used to make the
resume drop every later row silently and compute them again."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vitkit import fileio
from vitkit.errors import DataError
from vitkit.outputs.array_reader import read_embeddings
from vitkit.outputs.arrays import EmbeddingWriter
from vitkit.outputs.rows import Field, open_rows
from vitkit.outputs.store import Parts

META = {"vitkit.checkpoint": "a" * 64, "vitkit.precision": "fp32"}


def _batch(b: int) -> dict[str, Any]:
    v = np.arange(3, dtype=np.float32) + 10 * b
    return {"index": np.arange(3) + 3 * b, "id": [f"img{b}{i}" for i in range(3)], "label": np.full(3, b),
            "vector": np.stack([v, -v]).T}  # fmt: skip


def _chunks(out: Path, n: int) -> list[Path]:
    w = EmbeddingWriter(out, META)
    for b in range(n):
        w.write(_batch(b))
    w.release()  # a kill: the chunks stay, nothing assembled
    return [p for _, p in Parts.beside(out, ".npz").numbered()]


@pytest.mark.parametrize("damage", ["empty", "cut"])
def test_a_damaged_last_chunk_is_computed_again(tmp_path: Path, damage: str) -> None:
    out = tmp_path / "f.npy"
    chunks = _chunks(out, 3)
    data = chunks[-1].read_bytes()
    chunks[-1].write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    w = EmbeddingWriter(out, META, resume=True)  # was: EOFError / BadZipFile
    assert w.ids == [f"img{b}{i}" for b in range(2) for i in range(3)]
    for b in (2, 3):
        w.write(_batch(b))
    w.close()
    assert read_embeddings(out).ids == [f"img{b}{i}" for b in range(4) for i in range(3)]


@pytest.mark.parametrize("damage", ["empty", "cut", "flipped"])
def test_a_damaged_chunk_before_complete_ones_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    out = tmp_path / "f.parquet" if damage == "cut" else tmp_path / "f.safetensors"
    chunks = _chunks(out, 3)
    data = bytearray(chunks[1].read_bytes())
    if damage == "flipped":
        data[data.rfind(b"img1") + 3] ^= 1  # one bit of an id: the checksum tells
    chunks[1].write_bytes(b"" if damage == "empty" else bytes(data[: len(data) // 2] if damage == "cut" else data))
    with pytest.raises(DataError, match=f"{chunks[1]}: a damaged chunk") as e:
        EmbeddingWriter(out, META, resume=True)
    assert "\n" not in str(e.value)
    assert [p.name for p in chunks if p.exists()] == [p.name for p in chunks]  # nothing removed


def test_embed_resume_of_a_damaged_chunk_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command, end to end: a job stopped with its chunks on disk, its first chunk emptied; ``embed --resume``
    is one line naming the chunk, exit status 2 (was an EOFError traceback)."""
    from PIL import Image

    import vitkit
    from helpers import randomize_, run_cli
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.models import create_model

    model = create_model("Ti/16", patch_size=4, image_size=8, hidden_size=16, depth=1, num_heads=2, mlp_dim=16,
                         num_classes=3)  # fmt: skip
    ckpt = vitkit.save_pretrained(randomize_(model).eval(), tmp_path / "m", preprocess=Preprocess(image_size=8))  # type: ignore[arg-type]
    images = tmp_path / "in"
    images.mkdir()
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(images / f"{i}.png")
    out = tmp_path / "f.npy"
    argv = ["embed", str(ckpt), str(images), "--out", str(out), "--batch-size", "2", "--workers", "0",
            "--precision", "fp32"]  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(EmbeddingWriter, "_finish", lambda self: None)  # stopped before assembling: the chunks stay
        code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    chunks = [p for _, p in Parts.beside(out, ".npz").numbered()]
    assert len(chunks) == 2
    chunks[0].write_bytes(b"")
    code, _, err = run_cli(capsys, *argv, "--resume")
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{chunks[0]}: a damaged chunk" in err, err
    chunks[1].write_bytes(b"")
    chunks[0].unlink()  # nothing complete left before it: the chunk is computed again
    code, _, err = run_cli(capsys, *argv, "--resume")
    assert code == 0, err
    assert [Path(i).name for i in read_embeddings(out).ids] == [f"{i}.png" for i in range(4)]


def test_chunks_reach_the_disk_before_their_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync file" if stat.S_ISREG(os.fstat(fd).st_mode) else "fsync folder")
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        events.append(f"rename {os.fsdecode(dst)}")
        real_replace(src, dst, **kw)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    monkeypatch.setattr(fileio.os, "replace", replace)
    Parts(tmp_path / "parts", ".npz").write(0, lambda f: f.write(b"chunk"))
    assert events[:2] == ["fsync file", "rename part-00000000.npz"], events


def test_a_stray_quote_in_a_csv_output_is_refused(tmp_path: Path) -> None:
    """One stray ``"`` in row 1 of five: refused naming line 2 (the header is line 1); the file unchanged. A last
    row cut mid-write (no newline) is still dropped and written again."""
    out = tmp_path / "p.csv"
    fields = [Field("image", "str"), Field("score", "float")]
    w = open_rows(out, fields, id_field="image")
    w.write({"image": [f"img{i}" for i in range(5)], "score": np.arange(5, dtype=np.float32)})
    w.close()
    text = out.read_bytes()
    damaged = text.replace(b"img0,", b'img0",', 1)
    out.write_bytes(damaged)
    with pytest.raises(DataError, match=r"p\.csv: line 2 opens a quoted field that never closes"):
        open_rows(out, fields, id_field="image", resume=True)
    assert out.read_bytes() == damaged
    out.write_bytes(text + b"img5,5.")  # a kill mid-row
    w = open_rows(out, fields, id_field="image", resume=True)
    assert w.ids == [f"img{i}" for i in range(5)]
    w.close()
    assert out.read_bytes() == text
