"""The command line: in-process for speed, plus one real subprocess for the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, SRC
from vitkit.cli import build_parser, main

CKPT = str(FIXTURES / "official_vit_tiny.npz")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse exits for --help and usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "usage: vitkit" in out


def test_info_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "info", "B/16")
    assert code == 0 and "86,567,656" in out and "17.56 GMACs = 35.13 GFLOPs" in out
    code, out, _ = run(capsys, "info", "L/16", "--image-size", "384", "--num-classes", "10", "--json")
    doc = json.loads(out)
    assert doc["tokens"] == 577 and doc["config"]["num_classes"] == 10
    assert doc["gflops"] == pytest.approx(2 * doc["gmacs"])
    code, out, _ = run(capsys, "info", CKPT)
    assert code == 0 and "GELU tanh" in out


def test_predict_prints_top_k(capsys: pytest.CaptureFixture[str], sample_jpeg: Path) -> None:
    code, out, err = run(capsys, "predict", "--checkpoint", CKPT, str(sample_jpeg), str(sample_jpeg), "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["top"]) == 5  # the fixture has 5 classes
    probs = [t["prob"] for t in lines[0]["top"]]
    assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0, abs=1e-5)
    code, out, _ = run(capsys, "predict", "-c", CKPT, str(sample_jpeg), "--top-k", "2")
    assert code == 0 and "1. class" in out and "3." not in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["info", "Z/16"], "unknown model 'Z/16'"),
        (["info", "B/16", "--image-size", "200"], "not a multiple of patch size"),
        (["info", "B/16", "--image-size", "x"], "argument --image-size"),
        (["predict", "-c", "/nonexistent.npz", "IMG"], "/nonexistent.npz: no such file"),
        (["predict", "-c", CKPT, "/nonexistent.jpg"], "/nonexistent.jpg: no such file"),
        (["predict", "-c", CKPT, "IMG", "--top-k", "0"], "argument --top-k: must be positive"),
        (["predict", "IMG"], "--checkpoint"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], sample_jpeg: Path, argv: list[str], needle: str
) -> None:
    code, _out, err = run(capsys, *[str(sample_jpeg) if a == "IMG" else a for a in argv])
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_corrupt_image_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    code, _, err = run(capsys, "predict", "-c", CKPT, str(bad))
    assert code == 2 and str(bad) in err and len(err.strip().splitlines()) == 1


def test_console_entry_point_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    res = subprocess.run(
        [sys.executable, "-m", "vitkit", "info", "Ti/16"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "5,717,416" in res.stdout
