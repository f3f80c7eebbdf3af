"""Command-line values with bounds (issue 47, item 10): ``--workers`` at most a few per core of the machine,
``--batch-size`` within its memory, ``--num-classes`` not negative; each a one-line error, exit status 2, before
any work (no worker forked, no output opened)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from helpers import run_cli, tiny_checkpoint
from vitkit.hardware import WORKERS_PER_CORE, cpu_count


def one_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.strip().count("\n") == 0, err
    return err


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_workers_past_the_machines_bound_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    most = WORKERS_PER_CORE * cpu_count()
    ckpt = ["-c", "missing"] if command == "predict" else ["missing"]
    err = one_line(capsys, command, *ckpt, str(tmp_path / "x.png"), "--workers", str(most + 1))
    assert "--workers" in err and f"at most {most} worker processes" in err


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_a_batch_larger_than_memory_is_refused_before_any_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    ckpt = tiny_checkpoint(tmp_path, ["a", "b"])
    Image.new("RGB", (16, 16)).save(tmp_path / "x.png")
    out = tmp_path / ("p.csv" if command == "predict" else "e.npy")
    args = ["-c", str(ckpt)] if command == "predict" else [str(ckpt)]
    err = one_line(
        capsys, command, *args, str(tmp_path / "x.png"), "--batch-size", str(10**12), "--workers", "0",
        "--out", str(out),
    )  # fmt: skip
    assert "--batch-size 1000000000000" in err and "memory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "x.png"]  # no output, no lock, no sidecar


def test_negative_class_counts_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path, ["a", "b"])
    assert "--num-classes" in one_line(capsys, "info", str(ckpt), "--num-classes", "-7")
    err = one_line(capsys, "convert", str(ckpt), str(tmp_path / "out"), "--to", "vitkit", "--num-classes", "-3")
    assert "--num-classes" in err and not (tmp_path / "out").exists()
