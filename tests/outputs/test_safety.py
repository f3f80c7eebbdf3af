"""The outputs of ``vitkit predict`` and ``vitkit embed`` against planted and foreign files (issue 32, section 1):
never written through a symbolic link, resumed only when vitkit's writer marked them with this job's columns and
provenance, held by one job at a time, and read back on resume in bounded memory. Every refusal is one line, exit
status 2, and leaves every file as it was."""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import SRC, randomize_, run_cli
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.models import create_model

CLASSES = ["cat", "dog", "ship"]


def _ckpt(root: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=2, num_heads=2,
                                    mlp_dim=32, num_classes=3))  # fmt: skip
    return vitkit.save_pretrained(model.eval(), root / f"m{seed}", preprocess=Preprocess(image_size=16),
                                  class_names=CLASSES)  # fmt: skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return _ckpt(root, 0), _ckpt(root, 1)


def _images(folder: Path, n: int, start: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    return folder


def predict(capsys: pytest.CaptureFixture[str], ckpt: Path, *argv: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, "predict", "-c", str(ckpt), "--precision", "fp32", "--workers", "0", *argv)
    return code, err


def embed(capsys: pytest.CaptureFixture[str], ckpt: Path, *argv: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, "embed", str(ckpt), "--precision", "fp32", "--workers", "0", *argv)
    return code, err


def one_line(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(w in lines[0] for w in words), err


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target (not followed)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = p.read_bytes()
    return out


# ---- symbolic links ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_predict_never_writes_through_a_planted_symlink(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """``out -> victim`` (existing, with --resume or --overwrite) and a dangling ``out -> victim/new``: refused
    in one line naming the output; the victim's file is unchanged, the dangling target never created."""
    images = _images(tmp_path / "in", 2)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "bashrc").write_text("export PATH=/usr/bin\n")
    out = tmp_path / f"shared{suffix}"
    out.symlink_to(victim / "bashrc")
    for flags in (["--resume"], ["--overwrite"], []):
        one_line(*predict(capsys, ckpts[0], str(images), "--out", str(out), *flags), str(out), "symbolic link")
    assert (victim / "bashrc").read_text() == "export PATH=/usr/bin\n"
    dangling = tmp_path / f"new{suffix}"
    dangling.symlink_to(victim / "new_file")
    for flags in (["--resume"], []):
        one_line(*predict(capsys, ckpts[0], str(images), "--out", str(dangling), *flags), str(dangling))
    assert not (victim / "new_file").exists()
    assert sorted(p.name for p in victim.iterdir()) == ["bashrc"]


@pytest.mark.parametrize("suffix", [".npy", ".parquet", ".safetensors"])
def test_embed_never_writes_through_a_planted_symlink(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    images = _images(tmp_path / "in", 2)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"precious")
    out = tmp_path / f"f{suffix}"
    out.symlink_to(victim / "keep")
    for flags in (["--resume"], ["--overwrite"], []):
        one_line(*embed(capsys, ckpts[0], str(images), "--out", str(out), *flags), str(out))
    out.unlink()
    out.symlink_to(victim / "new")  # dangling
    one_line(*embed(capsys, ckpts[0], str(images), "--out", str(out)), str(out))
    out.unlink()
    if suffix == ".npy":  # the ids file beside it, planted
        side = tmp_path / "f.ids.json"
        side.symlink_to(victim / "keep")
        one_line(*embed(capsys, ckpts[0], str(images), "--out", str(out), "--overwrite"), str(side))
    parts = tmp_path / f"f{suffix}.parts"  # a chunk folder pointing elsewhere
    (victim / "part-00000000.npz").write_bytes(b"precious")
    parts.symlink_to(victim)
    one_line(*embed(capsys, ckpts[0], str(images), "--out", str(out), "--resume"), str(parts))
    assert snapshot(victim) == {"keep": b"precious", "part-00000000.npz": b"precious"}


def test_a_fifo_as_output_is_refused_without_blocking(tmp_path: Path, ckpts: tuple[Path, Path]) -> None:
    """A FIFO named like an output (a writer would block on it for ever): refused at once, in one line."""
    images = _images(tmp_path / "in", 1)
    fifo = tmp_path / "o.jsonl"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    for flags in (["--resume"], ["--overwrite"]):
        argv = [sys.executable, "-m", "vitkit", "predict", "-c", str(ckpts[0]), str(images), "--out", str(fifo), *flags]
        try:
            res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vitkit predict {' '.join(flags)} blocked on a FIFO output")
        one_line(res.returncode, res.stderr, str(fifo), "not a regular")


# ---- foreign and damaged files -------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_resume_and_overwrite_refuse_a_file_vitkit_did_not_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """A user's notes named like an output: neither --resume nor --overwrite touches them."""
    images = _images(tmp_path / "in", 2)
    notes = tmp_path / f"notes{suffix}"
    notes.write_text("buy milk\ncall mum\n")
    code, err = predict(capsys, ckpts[0], str(images), "--out", str(notes), "--resume")
    one_line(code, err, str(notes), "not an output vitkit wrote")
    code, err = predict(capsys, ckpts[0], str(images), "--out", str(notes), "--overwrite")
    one_line(code, err, str(notes), "not written by vitkit")
    assert notes.read_text() == "buy milk\ncall mum\n"
    assert {p.name for p in tmp_path.iterdir()} <= {"in", notes.name, notes.name + ".vitkit.lock"}  # no mark made


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_resume_refuses_a_damaged_row_in_the_middle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """One damaged line among six rows: refused, naming the file and the line, nothing dropped or rewritten; an
    unterminated last line alone is what a kill leaves, and is written again."""
    images = _images(tmp_path / "in", 6)
    out = tmp_path / f"o{suffix}"
    assert predict(capsys, ckpts[0], str(images), "--out", str(out), "--batch-size", "1")[0] == 0
    lines = out.read_bytes().splitlines(keepends=True)
    damaged = b"".join([*lines[:3], b"\x00garbage\n", *lines[4:]])
    out.write_bytes(damaged)
    code, err = predict(capsys, ckpts[0], str(images), "--out", str(out), "--batch-size", "1", "--resume")
    one_line(code, err, str(out), "line 4")
    assert out.read_bytes() == damaged
    whole = b"".join(lines)
    out.write_bytes(whole[:-7])  # the last row cut mid-write
    code, err = predict(capsys, ckpts[0], str(images), "--out", str(out), "--batch-size", "1", "--resume")
    assert code == 0 and "wrote 6 rows" in err and "(5 were there already)" in err, err
    assert out.read_bytes()[: len(whole) - len(lines[-1])] == whole[: -len(lines[-1])]  # the 5 rows untouched
    # the last row written again: the same row, its probabilities to fp32 rounding (on a loaded machine the fast
    # path's kernel race, which idle cores skip for a model this small, may pick another kernel for the rerun)
    assert _fields(out.read_text().splitlines()[-1], suffix) == pytest.approx(_fields(lines[-1].decode(), suffix))


def _fields(line: str, suffix: str) -> list[Any]:
    """A written row's values: strings as they are, numbers as floats."""
    values = list(json.loads(line).values()) if suffix == ".jsonl" else next(csv.reader([line]))
    flat: list[Any] = []
    for v in values:
        for x in v if isinstance(v, list) else [v]:
            try:
                flat.append(float(x))
            except (TypeError, ValueError):
                flat.append(x)
    return flat


def test_a_foreign_parquet_file_is_neither_resumed_nor_overwritten(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = _images(tmp_path / "in", 2)
    out = tmp_path / "sales.parquet"
    pq.write_table(pa.table({"month": [1, 2], "sales": [3.0, 4.0]}), out)
    before = out.read_bytes()
    one_line(*predict(capsys, ckpts[0], str(images), "--out", str(out), "--resume"), str(out))
    one_line(*predict(capsys, ckpts[0], str(images), "--out", str(out), "--overwrite"), str(out), "not written")
    assert out.read_bytes() == before


# ---- provenance ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_predict_resume_refuses_another_checkpoint_precision_or_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """Started with checkpoint A (2 of 6 images), resumed with B, with bf16, or from another working directory
    with the same relative ids: refused, the output unchanged; resumed as started: finished."""
    for where in ("a", "b"):
        _images(tmp_path / where / "in", 2)
    out = tmp_path / f"o{suffix}"
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "a")
        assert predict(capsys, ckpts[0], "in", "--out", str(out))[0] == 0
        _images(tmp_path / "a" / "in", 4, start=2)
        before = snapshot(tmp_path)
        one_line(*predict(capsys, ckpts[1], "in", "--out", str(out), "--resume"), str(out), "checkpoint")
        code, _, err = run_cli(capsys, "predict", "-c", str(ckpts[0]), "in", "--precision", "bf16", "--workers", "0",
                               "--out", str(out), "--resume")  # fmt: skip
        one_line(code, err, str(out), "precision fp32", "bf16")
        os.chdir(tmp_path / "b")
        one_line(*predict(capsys, ckpts[0], "in", "--out", str(out), "--resume"), str(out), "input")
        assert snapshot(tmp_path) == before
        os.chdir(tmp_path / "a")
        code, err = predict(capsys, ckpts[0], "in", "--out", str(out), "--resume")
        assert code == 0 and "wrote 6 rows" in err and "(2 were there already)" in err, err
    finally:
        os.chdir(cwd)


def test_embed_resume_refuses_another_checkpoint_or_precision(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path]
) -> None:
    """The interrupted chunks of checkpoint A in fp32, resumed with B or in bf16: refused, nothing changed."""
    images = _images(tmp_path / "in", 4)
    out = tmp_path / "f.npy"
    assert embed(capsys, ckpts[0], str(images), "--out", str(out), "--batch-size", "2")[0] == 0
    parts = tmp_path / "f.npy.parts"
    parts.mkdir()  # what a killed run leaves: its options and one chunk (rebuilt from the finished file's meta)
    doc = json.loads((tmp_path / "f.ids.json").read_text())
    (parts / "meta.json").write_text(json.dumps(doc["meta"]))
    np.savez(parts / "part-00000000.npz", index=np.arange(2), id=np.asarray(doc["ids"][:2]), label=-np.ones(2, int),
             vector=np.load(out)[:2], error=np.asarray(["", ""]))  # fmt: skip
    out.unlink()
    (tmp_path / "f.ids.json").unlink()
    before = snapshot(tmp_path)
    one_line(*embed(capsys, ckpts[1], str(images), "--out", str(out), "--resume"), str(parts), "checkpoint")
    code, _, err = run_cli(capsys, "embed", str(ckpts[0]), str(images), "--precision", "bf16", "--workers", "0",
                           "--out", str(out), "--resume")  # fmt: skip
    one_line(code, err, str(parts), "precision")
    assert snapshot(tmp_path) == before
    code, err = embed(capsys, ckpts[0], str(images), "--out", str(out), "--resume", "--batch-size", "2")
    assert code == 0 and "(2 were there already)" in err, err


# ---- one job per output ------------------------------------------------------------------------------------


def _hold(kind: str, out: str, ready: Any, done: Any) -> None:
    """In another process: open ``out`` for writing as a job does, and keep it open until ``done``."""
    from vitkit.outputs.arrays import EmbeddingWriter
    from vitkit.outputs.rows import Field, open_rows

    if kind == "rows":
        w = open_rows(out, [Field("index", "int"), Field("image", "str")], id_field="image", resume=True)
        w.write({"index": [0], "image": ["x"]})
    else:
        w = EmbeddingWriter(out, {}, resume=True)  # type: ignore[assignment]
    ready.set()
    done.wait(60)
    w.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".npy"])
def test_a_second_job_on_an_output_in_use_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """While another process writes the output, a second run on it (--resume or --overwrite) is refused in one
    line, and the file is as the first process leaves it."""
    images = _images(tmp_path / "in", 2)
    out = tmp_path / f"o{suffix}"
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=("rows" if suffix == ".jsonl" else "vectors", str(out), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        before = snapshot(tmp_path)
        run = predict if suffix == ".jsonl" else embed
        for flags in (["--resume"], ["--overwrite"]):
            one_line(*run(capsys, ckpts[0], str(images), "--out", str(out), *flags), str(out), "another vitkit job")
        assert snapshot(tmp_path) == before
    finally:
        done.set()
        holder.join(60)
    assert holder.exitcode == 0


def test_two_real_predict_processes_on_one_output(tmp_path: Path) -> None:
    """A second ``vitkit predict --resume`` process started while the first writes the same output: refused in
    one line; the first writes every row once (no duplicated or broken line)."""
    n = 200
    images = _images(tmp_path / "in", n)
    model = randomize_(create_model("Ti/16", image_size=128, num_classes=3))  # slow enough to be caught mid-run
    ckpt = vitkit.save_pretrained(model.eval(), tmp_path / "m", preprocess=Preprocess(image_size=128))
    out = tmp_path / "o.jsonl"
    argv = [sys.executable, "-m", "vitkit", "predict", "-c", str(ckpt), str(images), "--precision", "fp32",
            "--workers", "0", "--batch-size", "1", "--out", str(out), "--resume"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    running = first.poll() is None  # the second ran while the first was writing
    assert first.wait(120) == 0, first.stderr.read().decode() if first.stderr else ""
    assert running, "the first run ended before the second one started: make it longer"
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1 and "another vitkit job" in lines[0], second.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(n))


# ---- bounded memory ----------------------------------------------------------------------------------------

_RSS = """
import sys
from vitkit.outputs.rows import Field, open_rows
fields = [Field("index", "int"), Field("image", "str"), Field("logits", "float_list", 1000)]
def hwm():  # this process's peak RSS in MiB (VmHWM: getrusage's maxrss carries the parent's over exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
base = hwm()
w = open_rows(sys.argv[1], fields, id_field="image", resume=True)
assert w.done == int(sys.argv[2]), w.done
print(hwm() - base)
"""


def test_resume_reads_a_large_output_in_bounded_memory(tmp_path: Path) -> None:
    """Resuming a 60 MB JSONL output costs a few MB of memory (its ids), not a multiple of the file."""
    from vitkit.outputs.rows import Field, open_rows

    out = tmp_path / "big.jsonl"
    fields = [Field("index", "int"), Field("image", "str"), Field("logits", "float_list", 1000)]
    w = open_rows(out, fields, id_field="image")
    n = 3000
    logits = np.random.default_rng(0).standard_normal((100, 1000)).astype(np.float32).tolist()
    for s in range(0, n, 100):
        w.write({"index": list(range(s, s + 100)), "image": [f"img{i}" for i in range(s, s + 100)], "logits": logits})
    w.close()
    size_mb = out.stat().st_size / 2**20
    assert size_mb > 50
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    res = subprocess.run([sys.executable, "-c", _RSS, str(out), str(n)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    grew_mb = float(res.stdout)
    assert grew_mb < 16, f"resume of a {size_mb:.0f} MB output grew the RSS by {grew_mb:.0f} MB"


# ---- file names ---------------------------------------------------------------------------------------------


def _named_images(folder: Path) -> list[bytes]:
    """Images whose names are not UTF-8, hold a terminal escape, or start like a spreadsheet formula."""
    names = [b"caf\xe9.png", b"\x1b[2Jclear.png", b"=HYPERLINK(1).png", b"-minus.png"]
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        rng = np.random.default_rng(i)
        buf = tmp = folder / f"tmp{i}.png"
        Image.fromarray(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8)).save(tmp)
        os.rename(bytes(buf), os.fsencode(folder) + b"/" + name)
    return names


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_non_utf8_and_formula_names_are_written_and_resumed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """A non-UTF-8 name is written as ``\\xe9`` (no UnicodeEncodeError in CSV or Parquet), a finished output
    resumes, and in CSV a cell starting like a formula is prefixed with ``'``."""
    import csv

    folder = tmp_path / "in"
    _named_images(folder)
    out = tmp_path / f"o{suffix}"
    cwd = os.getcwd()
    os.chdir(folder)  # ids as given: bare names, the first character of the cell
    try:
        code, err = predict(capsys, ckpts[0], "*.png", "--out", str(out))
        assert code == 0, err
        code, err = predict(capsys, ckpts[0], "*.png", "--out", str(out), "--resume")
        assert code == 0 and "(4 were there already)" in err, err
    finally:
        os.chdir(cwd)
    if suffix == ".csv":
        with out.open(newline="", encoding="utf-8") as f:
            cells = sorted(row[1] for row in list(csv.reader(f))[1:])
        assert cells == sorted(["caf\\xe9.png", "\x1b[2Jclear.png", "'=HYPERLINK(1).png", "'-minus.png"])


def test_names_on_the_console_never_carry_control_characters(tmp_path: Path, ckpts: tuple[Path, Path]) -> None:
    """On a strict UTF-8 console: rows printed with the names escaped (no ESC reaches the terminal, no
    UnicodeEncodeError), and a bad image's one-line error likewise."""
    folder = tmp_path / "in"
    _named_images(folder)
    (folder / "\x1b[31mbad.png").write_bytes(b"not an image")
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONIOENCODING": "utf-8:strict"}
    argv = [sys.executable, "-m", "vitkit", "predict", "-c", str(ckpts[0]), str(folder), "--precision", "fp32",
            "--workers", "0"]  # fmt: skip
    res = subprocess.run([*argv, "--skip-bad"], env=env, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert b"\x1b" not in res.stdout and b"\x1b" not in res.stderr
    assert b"caf\\xe9.png" in res.stdout and b"\\x1b[2Jclear.png" in res.stdout
    res = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    lines = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "\\x1b[31mbad.png" in lines[0], res.stderr
    assert b"\x1b" not in res.stderr


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet", ".npy", ".safetensors"])
def test_a_finished_or_failed_job_leaves_no_lock_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpts: tuple[Path, Path], suffix: str
) -> None:
    """Every finished output left ``NAME.vitkit.lock`` beside it (issue 48): the lock file goes with the job,
    whether it ends well or not, and the output can be locked again at once."""
    images = _images(tmp_path / "in", 3)
    out = tmp_path / "out" / f"o{suffix}"
    run = embed if suffix in (".npy", ".safetensors") else predict
    assert run(capsys, ckpts[0], str(images), "--out", str(out))[0] == 0
    (images / "bad.png").write_bytes(b"\x89PNG broken")
    assert run(capsys, ckpts[0], str(images), "--out", str(out), "--overwrite")[0] == 2
    assert not list((tmp_path / "out").glob("*.lock")), sorted(p.name for p in (tmp_path / "out").iterdir())
    assert run(capsys, ckpts[0], str(images), "--out", str(out), "--overwrite", "--skip-bad")[0] == 0
    assert not list((tmp_path / "out").glob("*.lock"))


def test_the_lock_file_is_removed_only_while_it_is_the_one_held(tmp_path: Path) -> None:
    """A lock file at the name that is not the file this process locked (the holder before it removed its own
    and another job made a new one) is not this job's: never removed by it, and not taken as held."""
    from vitkit.outputs.store import OutputLock

    lock = OutputLock(tmp_path / "o.csv")
    assert lock._holds_the_file()
    lock.path.unlink()
    lock.path.write_text("")  # another job's new lock file
    assert not lock._holds_the_file()
    lock.release()
    assert lock.path.exists()
