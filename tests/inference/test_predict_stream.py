"""``vitkit predict`` over any input, streamed: every input kind, every output format read back by its own
library, memory bounded by batch and prefetch (counted, not timed), resume after SIGKILL equal to an
uninterrupted run, bad images named or marked, and the Python API lazy for iterables."""

from __future__ import annotations

import csv
import importlib
import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import SRC, randomize_, run_cli, tiny_checkpoint
from vitkit import fileio
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset
from vitkit.errors import DataError
from vitkit.models import create_model

CLASSES = ["cat", "dog", "ship"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), CLASSES)


def png(path: Path, seed: int, size: tuple[int, int] = (20, 14)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def reference(ckpt: Path, images: list[Image.Image], k: int = 3, batch: int = 2) -> list[tuple[list[int], list[float]]]:
    """(top classes, their probabilities) of each image by the checkpoint's own model, computed directly in
    batches of ``batch`` (GEMMs round differently at other batch sizes)."""
    loaded = vitkit.load_checkpoint(ckpt)
    out = []
    for s in range(0, len(images), batch):
        x = torch.stack([loaded.meta.preprocess.to_tensor(img) for img in images[s : s + batch]])
        with torch.no_grad():
            p, i = loaded.model(x).softmax(-1).topk(k, dim=-1)
        out += [(i[j].tolist(), p[j].tolist()) for j in range(x.shape[0])]
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    """An output read back by its format's own library, as dicts with list columns."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        k = sum(1 for name in r if name.startswith("labels_"))
        d: dict[str, Any] = {"index": int(r["index"]), "image": r["image"], "labels": _spread(r, "labels", k, str)}
        d["classes"], d["probs"] = _spread(r, "classes", k, int), _spread(r, "probs", k, float)
        logits = [name for name in r if name.startswith("logits_")]
        if logits:
            d["logits"] = [float(r[name]) for name in logits]
        if "error" in r:
            d["error"] = r["error"]
        out.append(d)
    return out


def _spread(row: dict[str, str], name: str, k: int, kind: type) -> list[Any] | None:
    """A list field of a CSV row, spread over ``name_1`` .. ``name_k`` (None when empty: a failed image)."""
    values = [row[f"{name}_{j}"] for j in range(1, k + 1)]
    return None if all(v == "" for v in values) else [kind(v) for v in values]


def predict_cli(capsys: pytest.CaptureFixture[str], ckpt: Path, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "predict", "-c", str(ckpt), "--precision", "fp32", "--workers", "0", *argv)


# ---- inputs -------------------------------------------------------------------------------------------


def _shards(root: Path) -> list[Image.Image]:
    root.mkdir(parents=True)
    images = []
    with tarfile.open(root / "test-0000.tar", "w") as tf:
        for k in range(5):
            img = Image.fromarray(np.random.default_rng(k).integers(0, 256, (10, 12, 3), dtype=np.uint8))
            images.append(img)
            for name, data in ((f"s{k:03d}.png", _png_bytes(img)), (f"s{k:03d}.cls", str(k % 3).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return images


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["files", "folder", "glob", "imagefolder", "shards", "npz", "digits", "hf"])
def test_every_input_kind_gives_one_row_per_image_with_its_id(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, kind: str
) -> None:
    photos = tmp_path / "photos"
    files = [png(photos / "b.png", 1), png(photos / "a" / "x.png", 2), png(photos / "a" / "deep" / "y.png", 3)]
    (photos / "notes.txt").write_text("not an image")
    data: tuple[str, str] | None = None  # (--data, --split)
    if kind == "files":
        argv, ids = [str(files[0]), str(files[2])], [str(files[0]), str(files[2])]
    elif kind == "folder":  # recursive, sorted, the text file left out
        argv, ids = [str(photos)], sorted(str(f) for f in files)
    elif kind == "glob":
        argv, ids = [str(photos / "**" / "*.png")], sorted(str(f) for f in files)
    elif kind == "imagefolder":
        for c, seed in (("cat", 4), ("dog", 5), ("dog", 6)):
            png(tmp_path / "ds" / "test" / c / f"{seed}.png", seed)
        data = (str(tmp_path / "ds"), "test")
        ids = [str(p) for p in open_dataset(*data).paths]  # type: ignore[attr-defined]
    elif kind == "shards":
        _shards(tmp_path / "wds")
        data = (str(tmp_path / "wds"), "test")
        ids = [f"{tmp_path / 'wds' / 'test-0000.tar'}:s{k:03d}.png" for k in range(5)]
    elif kind == "npz":
        arrays = np.random.default_rng(0).integers(0, 256, (4, 9, 9, 3), dtype=np.uint8)
        np.savez(tmp_path / "a.npz", test_images=arrays, test_labels=np.arange(4) % 3)
        data = (str(tmp_path / "a.npz"), "test")
        ids = [f"{tmp_path / 'a.npz'}[{i}]" for i in range(4)]
    elif kind == "digits":
        data = ("digits", "test")
        ids = [f"digits[{i}]" for i in range(359)]
    else:
        datasets = pytest.importorskip("datasets")
        feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
        imgs = [Image.fromarray(np.full((9, 9, 3), 40 * i, np.uint8)) for i in range(3)]
        rows = {"image": [{"bytes": _png_bytes(im), "path": None} for im in imgs], "label": [0, 1, 2]}
        datasets.Dataset.from_dict(rows, features=feats).to_parquet(tmp_path / "pets.parquet")
        data = (str(tmp_path / "pets.parquet"), "train")  # a lone file is the train split
        ids = [f"{tmp_path / 'pets.parquet'} (train) row {i}" for i in range(3)]
    if data is not None:
        argv = ["--data", data[0], "--split", data[1]]
        ds = open_dataset(*data)
        images = [ds[i][0] for i in range(len(ds))]
    else:
        images = [Image.open(i).convert("RGB") for i in ids]
    out = tmp_path / "out.jsonl"
    code, _, err = predict_cli(capsys, ckpt, *argv, "--out", str(out), "--batch-size", "2")
    assert code == 0, err
    rows = read_rows(out)
    assert [r["image"] for r in rows] == ids and [r["index"] for r in rows] == list(range(len(ids)))
    want = reference(ckpt, images)
    assert [r["classes"] for r in rows] == [c for c, _ in want]
    assert [r["labels"] for r in rows] == [[CLASSES[j] for j in c] for c, _ in want]
    got_p, want_p = np.array([r["probs"] for r in rows], np.float32), np.array([p for _, p in want], np.float32)
    # --precision fp32: the model itself, to fp32's rounding (the job's thread count may split oneDNN's GEMMs
    # otherwise than this process's; Zen 5, family 26: 2.5e-7 relative at most)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-7)
    assert f"wrote {len(ids)} rows to {out}" in err


# ---- outputs ------------------------------------------------------------------------------------------


def test_every_output_format_read_back_by_its_library(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    import pandas as pd
    import pyarrow.parquet as pq

    files = [str(png(tmp_path / "in" / f"{i:02d}.png", i)) for i in range(7)]
    want = reference(ckpt, [Image.open(f).convert("RGB") for f in files], k=2, batch=3)
    loaded = vitkit.load_checkpoint(ckpt)
    x = torch.stack([loaded.meta.preprocess(f) for f in files])
    with torch.no_grad():
        logits = loaded.model(x).numpy()
    got = {}
    for suffix in (".jsonl", ".csv", ".parquet"):
        out = tmp_path / f"out{suffix}"
        code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out), "--top-k", "2", "--logits",
                                   "--batch-size", "3")  # fmt: skip
        assert code == 0, err
        rows = read_rows(out)
        assert [r["image"] for r in rows] == files
        assert [r["classes"] for r in rows] == [c for c, _ in want]
        np.testing.assert_allclose([r["probs"] for r in rows], [p for _, p in want], rtol=1e-6)
        np.testing.assert_allclose([r["logits"] for r in rows], logits, rtol=1e-5, atol=1e-6)  # batch of 7 vs 3
        got[suffix] = rows
    assert not (tmp_path / "out.parquet.parts").exists()  # merged into the file, then removed
    table = pq.read_table(tmp_path / "out.parquet")
    assert str(table.schema.field("probs").type) == "list<element: float>" and table.num_rows == 7
    frame = pd.read_parquet(tmp_path / "out.parquet")
    assert list(frame["image"]) == files
    frame = pd.read_csv(tmp_path / "out.csv")
    assert list(frame.columns[:5]) == ["index", "image", "labels_1", "labels_2", "classes_1"]
    np.testing.assert_array_equal(frame["logits_3"], [r["logits"][2] for r in got[".jsonl"]])
    code, _, err = predict_cli(capsys, ckpt, files[0], "--out", str(tmp_path / "out.csv"))
    assert code == 2 and "already exists" in err and "--resume" in err  # never replaced without being asked
    code, _, err = predict_cli(capsys, ckpt, files[0], "--out", str(tmp_path / "out.txt"))
    assert code == 2 and "unknown format '.txt'" in err


# ---- memory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "prefetch", "batch"), [(0, 2, 4), (2, 2, 4), (1, 3, 5)])
def test_images_decoded_at_once_stay_within_batch_and_prefetch(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch, workers: int, prefetch: int, batch: int
) -> None:
    """A folder of 60 images, more than the stream may hold: at no point are more images decoded and not yet
    written than (workers x prefetch + 1) batches. Counted where each image is decoded (in the worker
    processes, through a shared counter) and where each batch is written."""
    from vitkit.data import eval_transform
    from vitkit.data.stream import FileSource, list_inputs

    predict_module = importlib.import_module("vitkit.inference.predict")  # (the package exports the function)

    for i in range(60):
        png(tmp_path / "in" / f"{i:03d}.png", i)
    decoded = multiprocessing.get_context("fork").Value("i", 0)
    original = eval_transform.EvalTransform.__call__

    def counting(self: Any, img: Any, name: str = "image") -> torch.Tensor:
        with decoded.get_lock():
            decoded.value += 1
        return original(self, img, name)

    monkeypatch.setattr(eval_transform.EvalTransform, "__call__", counting)
    written, held = [0], []
    columns = predict_module.prediction_columns

    def observed(engine: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        held.append(decoded.value - written[0])  # decoded and not yet written, this batch included
        written[0] += len(b)
        return columns(engine, b, *args, **kwargs)

    monkeypatch.setattr(predict_module, "prediction_columns", observed)
    opts = predict_module.PredictOptions(batch_size=batch, precision="fp32", workers=workers, prefetch=prefetch,
                                         progress=False)  # fmt: skip
    source = FileSource(list_inputs([tmp_path / "in"]))
    summary = predict_module.predict_job(vitkit.load_checkpoint(ckpt), source, opts, out=tmp_path / "o.jsonl")
    assert summary.written == 60 and decoded.value == 60 and len(read_rows(tmp_path / "o.jsonl")) == 60
    bound = (workers * prefetch + 1) * batch
    assert max(held) <= bound < 60
    assert max(held) >= batch  # the current batch is counted: the instrument sees what it should


# ---- resume -------------------------------------------------------------------------------------------


def _rows_in(out: Path) -> int:
    if out.suffix == ".parquet":
        parts = out.with_name(out.name + ".parts")
        return 2 * len(list(parts.glob("part-*.parquet"))) if parts.is_dir() else 0
    try:
        return max(0, out.read_bytes().count(b"\n") - (out.suffix == ".csv"))
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize(
    "suffix", [".jsonl", pytest.param(".csv", marks=pytest.mark.slow), pytest.param(".parquet", marks=pytest.mark.slow)]
)  # ~10 s each, most of it a fresh interpreter importing torch; every format's cut-row handling is also below
def test_resume_after_sigkill_equals_an_uninterrupted_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str
) -> None:
    """A real ``vitkit predict`` process killed with SIGKILL mid-run, then ``--resume``: the output equals the
    one an uninterrupted run writes, nothing duplicated or lost."""
    model = randomize_(create_model("Ti/16", image_size=64, depth=4, num_classes=3))
    pre = Preprocess(image_size=64)
    ckpt = vitkit.save_pretrained(model.eval(), tmp_path / "m", preprocess=pre, class_names=CLASSES)
    n = 160
    for i in range(n):
        png(tmp_path / "in" / f"{i:03d}.png", i, (40, 30))
    # the precision pinned: the killed process and this one must compute alike on any CPU (auto measures; under
    # pytest --cpu-kind it is faked in this process only)
    argv = ["predict", "-c", str(ckpt), str(tmp_path / "in"), "--batch-size", "2", "--workers", "1", "--logits"]
    argv += ["--precision", "fp32"]
    out = tmp_path / f"killed{suffix}"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "vitkit", *argv, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while _rows_in(out) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()  # SIGKILL: no clean-up of any kind
    proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == -signal.SIGKILL, err  # killed, not finished
    cut = _rows_in(out)
    assert 0 < cut < n, err
    code, _, err = run_cli(capsys, *argv, "--out", str(out), "--resume")
    assert code == 0, err
    whole = tmp_path / f"whole{suffix}"
    code, _, err2 = run_cli(capsys, *argv, "--out", str(whole))
    assert code == 0, err2
    got, want = read_rows(out), read_rows(whole)
    assert [r["index"] for r in got] == list(range(n))
    assert got == want
    assert "were there already" in err


def test_rows_cut_mid_write_are_dropped_and_written_again(tmp_path: Path) -> None:
    """What a kill during a write leaves: a JSONL/CSV line without its newline (or a quoted field cut at a newline
    inside it), a temporary Parquet part never renamed, a merge's temporary file; reopened with resume, only the
    complete rows count, and the output ends complete and readable."""
    from vitkit.outputs.rows import Field, open_rows

    fields = [Field("index", "int"), Field("image", "str"), Field("probs", "float_list", 2)]

    def batch(start: int, n: int) -> dict[str, Any]:
        ids = [f"img\n{i}" if i == 3 else f"img{i}" for i in range(start, start + n)]  # a newline inside a field
        return {"index": list(range(start, start + n)), "image": ids, "probs": [[0.5, 0.25]] * n}

    for suffix in (".jsonl", ".csv", ".parquet"):
        out = tmp_path / f"o{suffix}"
        w = open_rows(out, fields, id_field="image")
        w.write(batch(0, 2))
        w.write(batch(2, 2))
        if suffix == ".parquet":  # a part file cut mid-write is never renamed into place; a merge cut short
            (out.with_name(out.name + ".parts") / ".part-00000002.parquet.tmp").write_bytes(b"PAR1 cut")
            cut = fileio.temp_path(out)
            cut.mkdir()  # the merge's private folder, a kill mid-write
            (cut / out.name).write_bytes(b"PAR1 cut")
        else:
            full = out.read_bytes()
            w.write(batch(4, 1))
            whole = out.read_bytes()
            out.write_bytes(whole[: len(full) + (len(whole) - len(full)) // 2])  # the last row cut in half
        w2 = open_rows(out, fields, id_field="image", resume=True)
        assert w2.done == 4 and w2.ids == [f"img{i}" if i != 3 else "img\n3" for i in range(4)], suffix
        w2.write(batch(4, 2))
        w2.close()
        rows = read_rows(out) if suffix != ".csv" else list(csv.DictReader(out.open(newline="")))
        assert [str(r["index"]) for r in rows] == [str(i) for i in range(6)], suffix
        assert not list(tmp_path.glob(".o*")) and not (tmp_path / "o.parquet.parts").exists()


def test_resume_refuses_another_input_and_finishes_a_complete_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    for i in range(4):
        png(tmp_path / "in" / f"{i}.png", i)
    out = tmp_path / "o.parquet"
    assert predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out))[0] == 0
    code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out), "--resume")
    assert code == 0 and "wrote 4 rows" in err and len(read_rows(out)) == 4  # nothing left: the file stays whole
    png(tmp_path / "in" / "4.png", 4)  # one more image: appended to the finished Parquet file
    code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out), "--resume")
    assert code == 0 and [r["index"] for r in read_rows(out)] == [0, 1, 2, 3, 4]
    (tmp_path / "in" / "0.png").rename(tmp_path / "in" / "00.png")
    code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out), "--resume")
    assert code == 2 and "row 1 is" in err and "the input changed" in err and len(err.strip().splitlines()) == 1
    code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--out", str(out), "--overwrite")
    assert code == 0 and read_rows(out)[0]["image"].endswith("00.png")


# ---- bad images ---------------------------------------------------------------------------------------


def test_bad_images_are_named_or_marked_failed_and_counted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    for i in range(5):
        png(tmp_path / "in" / f"{i}.png", i)
    corrupt = tmp_path / "in" / "3b.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff not a jpeg")
    empty = tmp_path / "in" / "9.png"
    empty.write_bytes(b"")
    code, _, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--batch-size", "2")
    errors = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:") and "%|" not in ln]
    assert code == 2 and len(errors) == 1 and str(corrupt) in errors[0] and "Traceback" not in err
    out = tmp_path / "o.csv"
    argv = [str(tmp_path / "in"), "--batch-size", "2", "--skip-bad"]
    code, stdout, err = predict_cli(capsys, ckpt, *argv, "--out", str(out))
    assert code == 0, err
    rows = read_rows(out)
    assert len(rows) == 7
    failed = {r["image"]: r["error"] for r in rows if r["error"]}
    assert set(failed) == {str(corrupt), str(empty)} and "empty file" in failed[str(empty)]
    assert all(r["classes"] is None and r["probs"] is None for r in rows if r["error"])
    assert "note: 2 of 7 image(s) failed" in err and str(corrupt) in err
    code, stdout, err = predict_cli(capsys, ckpt, str(tmp_path / "in"), "--skip-bad", "--json")
    docs = [json.loads(line) for line in stdout.splitlines()]
    assert len(docs) == 7 and docs[4]["image"] == str(corrupt) and docs[4]["top"] == [] and "error" in docs[4]


def test_skip_bad_with_data_decodes_nothing_before_the_stream(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--data`` with ``--skip-bad``: opening the dataset decodes no image (before, every image of an ImageFolder
    was decoded once, serially, before the first batch, in every process), and a corrupt image is a counted
    failed row of the stream, in its place."""
    import vitkit.data.folder as folder
    from vitkit.data.stream import open_source

    root = tmp_path / "data"
    for i in range(4):
        png(root / "test" / "a" / f"{i}.png", i)
    corrupt = root / "test" / "a" / "2b.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    decoded: list[str] = []
    real = folder.load_image

    def spy(path: Any) -> Any:
        decoded.append(str(path))
        return real(path)

    monkeypatch.setattr(folder, "load_image", spy)
    source = open_source([], str(root), "test", skip_bad=True)
    assert len(source) == 5 and decoded == []  # listed, nothing decoded
    out = tmp_path / "o.jsonl"
    code, _, err = predict_cli(capsys, ckpt, "--data", str(root), "--skip-bad", "--batch-size", "2", "--out", str(out))
    assert code == 0, err
    rows = read_rows(out)
    assert [r["image"] for r in rows] == [source.item_id(i) for i in range(5)]
    assert [r["image"] for r in rows if r.get("error")] == [str(corrupt)]
    assert "1 of 5 image(s) failed" in err, err
    assert sorted(decoded) == sorted(source.item_id(i) for i in range(5))  # once each: by the stream alone


# ---- Python API ---------------------------------------------------------------------------------------


def test_python_api_generator_in_generator_out_and_list_in_list_out(tmp_path: Path, ckpt: Path) -> None:
    files = [str(png(tmp_path / f"{i}.png", i)) for i in range(5)]
    pulled: list[int] = []

    def images() -> Any:
        for i, f in enumerate(files):
            pulled.append(i)
            yield f if i % 2 else Image.open(f).convert("RGB")

    lazy = vitkit.predict(ckpt, images(), top_k=2, batch_size=2)
    assert isinstance(lazy, types.GeneratorType) and pulled == []  # nothing read before it is asked for
    first = next(lazy)
    assert pulled == [0, 1] and first.image == "image 0"  # one batch read
    rest = list(lazy)
    listed = vitkit.predict(ckpt, files, top_k=2, batch_size=2, workers=1)
    assert isinstance(listed, list) and [p.image for p in listed] == files
    assert [p.top for p in [first, *rest]] == [p.top for p in listed]
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    with pytest.raises(DataError, match=r"bad\.png"):
        vitkit.predict(ckpt, [files[0], str(bad)])
    marked = vitkit.predict(ckpt, [files[0], str(bad)], skip_bad=True)
    assert marked[1].top == [] and "bad.png" in (marked[1].error or "") and marked[0].error is None


# ---- size bounds on the streaming path ----------------------------------------------------------------


def _jpeg_bytes(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 2, 3)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # the reference full decode; the reduced JPEG decode
def test_a_line_of_pixels_is_one_line_naming_the_file_on_every_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, precision: str
) -> None:
    """A centre-crop checkpoint refuses a 30000x1 JPEG in predict, eval and fewshot with one line naming the
    file (exit 2), streamed through decoding workers; on the fast path from the JPEG's header alone (a copy cut
    after its header, which no decoder can read, gets the same line, not a decode error). With --skip-bad it is
    a failed row."""
    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=1, num_heads=2,
                                    mlp_dim=32, num_classes=3))  # fmt: skip
    pre = Preprocess(image_size=16, resize="crop", crop_pct=0.875)
    crop = vitkit.save_pretrained(model.eval(), tmp_path / "crop", preprocess=pre, class_names=["a", "b", "c"])
    data = _jpeg_bytes((30000, 1))
    line, ok = tmp_path / "in" / "line.jpg", png(tmp_path / "in" / "ok.png", 0)
    line.write_bytes(data)
    engine = ["--precision", precision, "--workers", "1"]

    def one_error(err: str) -> str:
        lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith("note:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    words = "image of 30000x1 has an aspect ratio of 30000:1, over the limit of 1000:1 for a centre crop"
    code, out, err = run_cli(capsys, "predict", "-c", str(crop), *engine, str(ok), str(line))
    assert code == 2 and out == "" and one_error(err) == f"vitkit predict: error: {line}: {words}"
    if precision != "fp32":
        cut = tmp_path / "cut.jpg"
        sos = data.index(b"\xff\xda")  # the start-of-scan segment ends the header
        cut.write_bytes(data[: sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big") + 16])
        code, out, err = run_cli(capsys, "predict", "-c", str(crop), *engine, str(cut))
        assert code == 2 and one_error(err) == f"vitkit predict: error: {cut}: {words}"
    out_csv = tmp_path / "o.csv"
    code, _, err = run_cli(capsys, "predict", "-c", str(crop), *engine, str(ok), str(line), "--skip-bad",
                           "--out", str(out_csv))  # fmt: skip
    rows = read_rows(out_csv)
    assert code == 0 and [bool(r["error"]) for r in rows] == [False, True] and words in rows[1]["error"], err
    for split in ("train", "test"):
        for i, cls in enumerate("abc"):
            png(tmp_path / "data" / split / cls / "ok.png", i)
    bad = tmp_path / "data" / "train" / "b" / "line.jpg"
    bad.write_bytes(data)
    code, _, err = run_cli(capsys, "fewshot", str(crop), "--data", str(tmp_path / "data"), *engine, "--shots", "1",
                           "--seeds", "1", "--l2", "1")  # fmt: skip
    assert code == 2 and f"{bad}: {words}" in one_error(err)
    bad.rename(tmp_path / "data" / "test" / "b" / "line.jpg")
    code, _, err = run_cli(capsys, "eval", str(crop), "--data", str(tmp_path / "data"), *engine,
                           "--out", str(tmp_path / "ev"))  # fmt: skip
    assert code == 2 and f"{tmp_path / 'data' / 'test' / 'b' / 'line.jpg'}: {words}" in one_error(err)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_resume_with_skip_bad_continues_an_output_started_without_it_and_back(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, suffix: str
) -> None:
    """The usual way to meet --skip-bad: a run stopped at an image that would not decode, then --resume
    --skip-bad (issue 48: refused as "its columns are not those this job writes"). The output keeps its own
    columns: no error column in one started without --skip-bad (the failed row is empty, and counted)."""
    for i in range(4):
        png(tmp_path / "in" / f"{i}.png", i)
    corrupt = tmp_path / "in" / "3b.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff not a jpeg")
    png(tmp_path / "in" / "4.png", 4)
    out = tmp_path / f"o{suffix}"
    argv = [str(tmp_path / "in"), "--batch-size", "2", "--workers", "0", "--out", str(out)]
    code, _, err = predict_cli(capsys, ckpt, *argv)
    assert code == 2 and str(corrupt) in err
    code, _, err = predict_cli(capsys, ckpt, *argv, "--resume", "--skip-bad")
    assert code == 0, err
    assert "note: 1 of" in err and str(corrupt) in err
    rows = read_rows(out)
    assert [Path(r["image"]).name for r in rows] == ["0.png", "1.png", "2.png", "3.png", "3b.jpg", "4.png"]
    assert rows[4]["classes"] is None and rows[5]["classes"] is not None and "error" not in rows[0]
    # and the other way: started with --skip-bad, resumed without it
    out2 = tmp_path / f"p{suffix}"
    argv2 = [str(tmp_path / "in"), "--batch-size", "2", "--workers", "0", "--out", str(out2)]
    assert predict_cli(capsys, ckpt, *argv2, "--skip-bad")[0] == 0
    png(tmp_path / "in" / "5.png", 5)
    code, _, err = predict_cli(capsys, ckpt, *argv2, "--resume")
    assert code == 0, err  # the corrupt image's row is done: it is not read again
    assert [Path(r["image"]).name for r in read_rows(out2)][-1] == "5.png"
    assert read_rows(out2)[4]["error"]
