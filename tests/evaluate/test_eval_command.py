"""``vitkit eval`` and ``vitkit fewshot`` as commands (datasets injected where the CLI opens them)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eval_helpers import PRE, ListDataset, make_dataset, make_model
from test_cli import run
from vitkit import save_pretrained


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_pretrained(make_model(), tmp_path / "model", preprocess=PRE, class_names=["c0", "c1", "c2"])


@pytest.fixture
def datasets(monkeypatch: pytest.MonkeyPatch) -> dict[str, ListDataset]:
    splits = {"train": make_dataset(45, seed=1, expose=True), "test": make_dataset(21, seed=2)}

    def fake_open(source: str, split: str, skip_bad: bool) -> Any:
        assert source == "mem"
        return splits[split]

    monkeypatch.setattr("vitkit.cli._open", fake_open)
    return splits


def test_eval_command(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, datasets: Any) -> None:
    (tmp_path / "real.csv").write_text("key,labels\n0,c0 c1 c2\n1,\n")
    out = tmp_path / "ev"
    code, stdout, err = run(
        capsys, "eval", str(ckpt), "--data", "mem", "--out", str(out), "--real-labels", str(tmp_path / "real.csv"),
        "--batch-size", "8", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    assert "top-1" in stdout and "top-3" in stdout and "ReaL top-1 100.00% over 1 examples" in stdout
    doc = json.loads((out / "metrics.json").read_text())
    conf = np.array([r[1:] for r in list(csv.reader((out / "confusion.csv").open()))[1:]], dtype=int)
    assert conf.sum() == 21 and doc["top1"] == pytest.approx(np.trace(conf) / 21)
    assert (out / "confusion.png").stat().st_size > 1000 and (out / "per_class.csv").is_file()


def test_fewshot_command(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, datasets: Any) -> None:
    code, stdout, err = run(
        capsys, "fewshot", str(ckpt), "--data", "mem", "--shots", "1,5", "--seeds", "2", "--l2", "auto",
        "--heldout", "3", "--json", "--out", str(tmp_path / "fs.json"),
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc == json.loads((tmp_path / "fs.json").read_text())
    assert doc["l2_mode"] == "auto" and set(doc["shots"]) == {"1", "5"} and len(doc["shots"]["5"]["per_seed"]) == 2
    code, stdout, err = run(capsys, "fewshot", str(ckpt), "--data", "mem", "--shots", "2", "--seeds", "1")
    assert code == 0 and "2^10" in stdout, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fewshot", "{ckpt}", "--data", "mem", "--shots", "20"], "class 0 has only"),
        (["fewshot", "{ckpt}", "--data", "mem", "--shots", "1,x"], "invalid shots"),
        (["fewshot", "{ckpt}", "--data", "mem", "--l2", "0"], "l2 must be positive"),
        (["eval", "{ckpt}", "--data", "mem", "--real-labels", "nope.json"], "nope.json: no such label file"),
        (["eval", "{ckpt}/missing", "--data", "mem"], "missing: no such file or directory"),
        (["eval", "{ckpt}"], "--data"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], ckpt: Path, datasets: Any, argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, *(a.format(ckpt=ckpt) for a in argv))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
