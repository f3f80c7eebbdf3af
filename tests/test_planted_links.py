"""Every file vitkit writes goes through one write-then-rename helper that refuses links (issue 47, item 2), and
vitkit's temporary names are its own (item 8): a report, a figure or a resumed run's file whose name is a planted
symbolic link (dangling or not) is refused in one line naming it (exit status 2), never followed, the file it
points to untouched; a user's ``.NAME.old`` or ``.NAME.tmp-...`` is never deleted or moved."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import randomize_, run_cli
from vitkit import create_model, fileio, output_paths, save_pretrained
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError

NOBODY = 65534


def one_line(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(w in lines[0] for w in words), err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = create_model("Ti/16", patch_size=4, image_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=32,
                         num_classes=10)  # fmt: skip
    root = tmp_path_factory.mktemp("ck")
    return save_pretrained(randomize_(model).eval(), root / "m", preprocess=Preprocess(image_size=8),  # type: ignore[arg-type]
                           class_names=[str(c) for c in range(10)])  # fmt: skip


def victim(folder: Path, name: str = "diary.txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text("private\n")
    p.chmod(0o600)
    return p


# ---- the helper ---------------------------------------------------------------------------------------------


def test_write_file_atomic_refuses_a_link_and_names_it(tmp_path: Path) -> None:
    mine = victim(tmp_path / "home")
    for target in (mine, tmp_path / "home" / "new.txt"):  # a link to a file, a dangling link
        out = tmp_path / "out.json"
        out.symlink_to(target)
        with pytest.raises(ConfigError, match=re.escape(f"{out}: is a symbolic link")):
            fileio.write_text_atomic(out, "{}")
        assert out.is_symlink() and os.readlink(out) == str(target)
        out.unlink()
    assert mine.read_text() == "private\n" and not (tmp_path / "home" / "new.txt").exists()
    os.mkfifo(tmp_path / "fifo.png")
    with pytest.raises(ConfigError, match=r"fifo\.png: is not a regular file"):
        fileio.write_text_atomic(tmp_path / "fifo.png", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.png", "home"]  # no temporary left


def test_a_link_planted_while_writing_is_refused_not_followed(tmp_path: Path) -> None:
    """The destination is checked again right before the rename: a link planted while the file was being written
    is refused (and the writer wrote into vitkit's private folder, never to the destination's name)."""
    mine = victim(tmp_path / "home")
    out = tmp_path / "report" / "per_class.csv"
    seen: list[Path] = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("class,accuracy\n")
        out.symlink_to(mine)  # an attacker's link, planted after the first check

    with pytest.raises(ConfigError, match=r"per_class\.csv: is a symbolic link"):
        fileio.write_file_atomic(out, write)
    assert mine.read_text() == "private\n" and out.is_symlink()
    assert sorted(p.name for p in out.parent.iterdir()) == ["per_class.csv"]  # the private folder removed
    assert seen[0].name == "per_class.csv" and seen[0].parent != out.parent


def test_temporary_names_are_marked_private_and_unguessable(tmp_path: Path) -> None:
    out = tmp_path / "preds.csv"
    found: list[tuple[str, int]] = []

    def write(tmp: Path) -> None:
        [entry] = [e for e in tmp_path.iterdir() if e != out]
        found.append((entry.name, stat.S_IMODE(entry.stat().st_mode)))
        tmp.write_text("x")

    fileio.write_file_atomic(out, write)
    fileio.write_file_atomic(out, write)
    (a, mode), (b, _) = found
    assert re.fullmatch(r"\.preds\.csv\.vitkit-tmp-[0-9a-f]{16}", a) and a != b and mode == 0o700
    assert out.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["preds.csv"]
    assert stat.S_IMODE(out.stat().st_mode) == fileio.file_mode()


def test_clean_stale_touches_only_its_own_names(tmp_path: Path) -> None:
    """A user's ``.preds.csv.old`` file, ``.scores.jsonl.old/`` folder and ``.x.tmp-0123abcd`` are not vitkit's:
    left as they are; a name of vitkit's shape owned by another user is not touched either."""
    (tmp_path / ".preds.csv.old").write_text("my backup")
    (tmp_path / ".scores.jsonl.old").mkdir()
    (tmp_path / ".scores.jsonl.old" / "notes").write_text("mine")
    (tmp_path / ".x.tmp-0123abcd").write_text("mine too")
    theirs = fileio.temp_path(tmp_path / "y", "old")  # another user's (when we can make one): not ours
    if os.geteuid() == 0:
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)
    ours = fileio.temp_path(tmp_path / "z")
    ours.write_text("a kill's leftover")
    names = ["preds.csv", "scores.jsonl", "x", "y", "z"]
    done = fileio.clean_stale(tmp_path, names)
    assert done == [f"removed {ours.name}"]
    assert (tmp_path / ".preds.csv.old").read_text() == "my backup"
    assert (tmp_path / ".scores.jsonl.old" / "notes").read_text() == "mine"
    assert not (tmp_path / "scores.jsonl").exists() and (tmp_path / ".x.tmp-0123abcd").exists()
    assert theirs.is_dir() == (os.geteuid() == 0) and not (tmp_path / "y").exists()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_predict_keeps_a_users_dot_old(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, suffix: str
) -> None:
    """Item 8 as reported: a fresh ``predict --out preds.csv`` deleted ``.preds.csv.old``; with ``--out
    scores.jsonl`` the folder ``.scores.jsonl.old/`` was renamed to ``scores.jsonl`` and the job failed."""
    images = tmp_path / "in"
    images.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(images / "a.png")
    out = tmp_path / f"preds{suffix}"
    backup = tmp_path / f".{out.name}.old"
    if suffix == ".csv":
        backup.write_text("yesterday's predictions")
    else:
        backup.mkdir()
        (backup / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "predict", "-c", str(ckpt), str(images), "--out", str(out), "--workers", "0",
                           "--precision", "fp32")  # fmt: skip
    assert code == 0, err
    assert out.is_file() and "a.png" in out.read_text()
    if suffix == ".csv":
        assert backup.read_text() == "yesterday's predictions"
    else:
        assert (backup / "notes.txt").read_text() == "mine"


# ---- the commands -------------------------------------------------------------------------------------------


def test_eval_report_never_written_through_planted_links(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    """``vitkit eval --out rep`` where ``rep/per_class.csv`` and ``rep/confusion.png`` are links to a user's
    files: refused in one line naming the link, before any evaluation; both files unchanged. A dangling
    ``metrics.json`` link likewise: its target is never created."""
    home = tmp_path / "home"
    notes, photo = victim(home, "notes.csv"), victim(home, "photo.png")
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "per_class.csv").symlink_to(notes)
    (rep / "confusion.png").symlink_to(photo)
    argv = ["eval", str(ckpt), "--data", "digits", "--out", str(rep), "--device", "cpu", "--precision", "fp32"]
    one_line(*run_cli(capsys, *argv)[::2], "confusion.png", "symbolic link")
    (rep / "confusion.png").unlink()
    one_line(*run_cli(capsys, *argv)[::2], "per_class.csv", "symbolic link")
    (rep / "per_class.csv").unlink()
    (rep / "metrics.json").symlink_to(home / "created.json")
    one_line(*run_cli(capsys, *argv)[::2], "metrics.json", "symbolic link")
    assert notes.read_text() == photo.read_text() == "private\n"
    assert sorted(p.name for p in home.iterdir()) == ["notes.csv", "photo.png"]
    (rep / "metrics.json").unlink()
    code, _, err = run_cli(capsys, *argv)  # the same folder without links: written
    assert code == 0, err
    assert sorted(p.name for p in rep.iterdir()) == ["confusion.csv", "confusion.png", "metrics.json", "per_class.csv"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another user's folder and link")
def test_eval_across_users_leaves_the_victims_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    """The reported cross-user case: a world-writable folder made by one user (here uid 65534), linking
    ``per_class.csv`` to another user's private file; that user's eval into the folder is refused and the
    private file keeps its contents and mode."""
    private = victim(tmp_path / "victim")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    os.chown(shared, NOBODY, NOBODY)
    (shared / "per_class.csv").symlink_to(private)
    os.lchown(shared / "per_class.csv", NOBODY, NOBODY)
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--data", "digits", "--out", str(shared), "--device", "cpu",
                           "--precision", "fp32")  # fmt: skip
    one_line(code, err, str(shared / "per_class.csv"), "symbolic link")
    assert private.read_text() == "private\n" and stat.S_IMODE(private.stat().st_mode) == 0o600
    assert sorted(p.name for p in shared.iterdir()) == ["per_class.csv"]


def test_eval_report_link_planted_after_the_check(tmp_path: Path) -> None:
    """The report writer itself (not only the pre-check) refuses a link that appears after the folder was checked:
    the figure is written by the helper, which looks again right before its rename."""
    from vitkit.evaluate.evaluate import EvalReport, write_eval_report
    from vitkit.evaluate.metrics import compute_metrics

    mine = victim(tmp_path / "home", "photo.png")
    report = EvalReport(compute_metrics(torch.randn(6, 3).numpy(), np.array([0, 1, 2, 0, 1, 2]), 3), ["a", "b", "c"])
    rep = tmp_path / "rep"
    real = output_paths.check_report_dir

    def check_then_plant(*args: object, **kw: object) -> None:
        real(*args, **kw)  # type: ignore[arg-type]
        rep.mkdir(exist_ok=True)
        (rep / "confusion.png").symlink_to(mine)

    import vitkit.evaluate.evaluate as ev

    ev.check_report_dir = check_then_plant  # type: ignore[assignment]
    try:
        with pytest.raises(ConfigError, match=r"confusion\.png: is a symbolic link"):
            write_eval_report(report, rep)
    finally:
        ev.check_report_dir = real
    assert mine.read_text() == "private\n"


def test_analyze_never_writes_through_a_planted_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    mine = victim(tmp_path / "home", "photo.png")
    image = tmp_path / "a.png"
    Image.fromarray(np.full((8, 8, 3), 99, dtype=np.uint8)).save(image)
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "attention_rollout.png").symlink_to(mine)
    code, _, err = run_cli(capsys, "analyze", str(ckpt), str(image), "--out", str(rep), "--device", "cpu")
    one_line(code, err, str(rep / "attention_rollout.png"), "symbolic link")
    (rep / "attention_rollout.png").unlink()
    (rep / "summary.json").symlink_to(tmp_path / "home" / "summary.json")  # dangling
    code, _, err = run_cli(capsys, "analyze", str(ckpt), str(image), "--out", str(rep), "--device", "cpu")
    one_line(code, err, str(rep / "summary.json"), "symbolic link")
    assert mine.read_text() == "private\n" and sorted(p.name for p in mine.parent.iterdir()) == ["photo.png"]


def test_a_report_folder_that_is_a_link_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path
) -> None:
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    (tmp_path / "rep").symlink_to(elsewhere)
    code, _, err = run_cli(capsys, "analyze", str(ckpt), "--out", str(tmp_path / "rep"), "--device", "cpu")
    one_line(code, err, str(tmp_path / "rep"), "symbolic link")
    assert list(elsewhere.iterdir()) == []
