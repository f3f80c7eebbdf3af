"""An output inside the folder it reads (issue 48, item 9): ``predict -c CK mydata/val --out mydata/val/preds.csv``
wrote the file there, where the next run on ``mydata/val`` would read it as data, though getting-started.md says
such an output is refused. Every command that reads a folder and writes --out refuses it in one line, before
any work (the checkpoint named here does not exist: the refusal must come first)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from helpers import run_cli

MISSING_CKPT = "./missing-checkpoint.npz"


@pytest.mark.parametrize(
    "argv",
    [
        ["predict", "-c", MISSING_CKPT, "{val}", "--out", "{val}/preds.csv"],
        ["predict", "-c", MISSING_CKPT, "--data", "{data}", "--out", "{data}/preds.jsonl"],
        ["embed", MISSING_CKPT, "{val}", "--out", "{val}/a/feats.npy"],
        ["eval", MISSING_CKPT, "--data", "{data}", "--out", "{data}/report"],
        ["knn", MISSING_CKPT, "--data", "{data}", "--out", "{data}/knn.json"],
        ["fewshot", MISSING_CKPT, "--data", "{data}", "--out", "{data}/fewshot.json"],
        ["analyze", MISSING_CKPT, "--data", "{data}", "--out", "{val}/analysis"],
    ],
)
def test_an_output_inside_a_folder_input_is_refused_before_any_work(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "mydata"
    for c in ("a", "b"):
        (data / "val" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(data / "val" / c / "0.png")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    code, _, err = run_cli(capsys, *[a.replace("{val}", str(data / "val")).replace("{data}", str(data)) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "lies inside the input" in lines[0] and "missing-checkpoint" not in lines[0]
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
