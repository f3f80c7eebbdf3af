"""Every command checks where it will write before it does any work (issue 25 item 14): ``vitkit eval --out``
refused an unusable folder only after the whole evaluation.

Each case gives a command an output it cannot use AND a checkpoint or data set that does not exist: the one-line
error must be about the output, which proves the output was judged before the model or data was even looked
up (let alone loaded, or run forward). A file standing where a folder of the output path should be is the
unusable place every command shares; the commands that write folders are also given a folder holding a user's
file, which they must refuse (and keep) up front.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import run_cli
from vitkit import output_paths
from vitkit.errors import ConfigError

MISSING_CKPT = "./missing-checkpoint.npz"  # spelled as a path: refused without any lookup or download
MISSING_DATA = "./missing-images"


def _cases(tmp: Path) -> dict[str, list[str]]:
    """Each command with an output under ``tmp/blocker``, a regular file."""
    b = tmp / "blocker"
    ckpt, data = MISSING_CKPT, MISSING_DATA
    linear = ["finetune", ckpt, "--data", data, "--method", "linear"]
    return {
        "eval": ["eval", ckpt, "--data", data, "--out", str(b / "report")],
        "fewshot": ["fewshot", ckpt, "--data", data, "--out", str(b / "fewshot.json")],
        "embed": ["embed", ckpt, "--data", data, "--out", str(b / "feats.parquet")],
        "embed-npy": ["embed", ckpt, data, "--out", str(b / "feats.npy")],
        "knn": ["knn", ckpt, "--data", data, "--out", str(b / "knn.json")],
        "analyze": ["analyze", ckpt, "--data", data, "--out", str(b / "analysis")],
        "convert": ["convert", ckpt, str(b / "converted"), "--to", "vitkit"],
        "convert-npz": ["convert", ckpt, str(b / "converted.npz"), "--to", "official"],
        "export": ["export", ckpt, str(b / "model.onnx")],
        "train": ["train", "--recipe", "cifar-small", "--data", data, "--out", str(b / "run")],
        "finetune": ["finetune", ckpt, "--data", data, "--out", str(b / "run")],
        "finetune-default": ["finetune", ckpt, "--data", data],  # runs/finetune, with runs a file (cwd = tmp)
        "finetune-linear": ["finetune", ckpt, "--data", data, "--method", "linear", "--out", str(b / "run")],
        "finetune-lp-ft-default": ["finetune", ckpt, "--data", data, "--method", "lp-ft"],
        "finetune-lora": ["finetune", ckpt, "--data", data, "--method", "lora", "--save-adapters", "--out", str(b)],
        "finetune-cache": [*linear, "--feature-cache", str(b / "features"), "--out", str(tmp / "run")],
        "bench-json": ["bench", ckpt, "--json", str(b / "bench.json")],
        "bench-plot": ["bench", ckpt, "--image-size", "32", "64", "--plot", str(b / "curve.png")],
        "download": ["download", "http://127.0.0.1:9/vit.npz", "--cache-dir", str(b / "cache")],
        "download-file": ["download", "http://127.0.0.1:9/vit.npz", "--cache-dir", str(b)],
    }


@pytest.mark.parametrize("case", list(_cases(Path("/"))))
def test_an_output_under_a_file_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blocker").write_text("a user's file")
    (tmp_path / "runs").write_text("a user's file named runs")
    code, _, err = run_cli(capsys, *_cases(tmp_path)[case])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert ("blocker" in lines[0] or "runs" in lines[0]) and "missing" not in lines[0], lines[0]
    assert (tmp_path / "blocker").read_text() == "a user's file"


def _users_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


@pytest.mark.parametrize(
    ("case", "argv"),
    [
        ("eval", ["eval", MISSING_CKPT, "--data", MISSING_DATA, "--out", "{out}"]),
        ("analyze", ["analyze", MISSING_CKPT, "--data", MISSING_DATA, "--out", "{out}"]),
        ("convert", ["convert", MISSING_CKPT, "{out}", "--to", "hf", "--overwrite"]),
    ],
)
def test_a_folder_of_someone_elses_files_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str, argv: list[str]
) -> None:
    out = _users_folder(tmp_path / "mine")
    code, _, err = run_cli(capsys, *[a.replace("{out}", str(out)) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "notes.txt" in lines[0] and "missing" not in lines[0], err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_run_folder_is_judged_before_the_checkpoint_is_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """finetune read its checkpoint (finetune_config) before the run folder was claimed."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,loss\n1,0.5\n")
    (run / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "finetune", MISSING_CKPT, "--data", MISSING_DATA, "--out", str(run))
    assert code == 2 and "already holds a run" in err and "missing" not in err, err


def test_training_never_overwrites_a_users_files_in_its_run_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run writes steps.csv, curves.png, tb/ and best/ too (and deleted steps.csv and metrics.csv at its start):
    a folder holding a user's file of one of those names is refused and the file kept."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "steps.csv").write_text("my measurements\n")
    code, _, err = run_cli(capsys, "train", "--steps", "1", "--out", str(out), "--quiet")
    assert code == 2 and "steps.csv" in err and len(err.strip().splitlines()) == 1, err
    assert (out / "steps.csv").read_text() == "my measurements\n"
    assert sorted(p.name for p in out.iterdir()) == ["steps.csv"]


def test_a_linear_head_never_overwrites_a_users_probe_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--method linear and lp-ft write probe.json beside the model: a folder holding one is refused up front."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "probe.json").write_text("{}")
    code, _, err = run_cli(capsys, "finetune", MISSING_CKPT, "--data", MISSING_DATA, "--method", "linear",
                           "--out", str(out))  # fmt: skip
    assert code == 2 and "probe.json" in err and "missing" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["probe.json"]


def test_a_place_that_cannot_be_written_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only folder (simulated: these tests may run as root, whom permissions do not stop)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro and real_access(p, mode))
    for check in (
        lambda: output_paths.check_output_location(ro / "sub" / "out.json"),
        lambda: output_paths.check_output_location(ro, inside=True),
        lambda: output_paths.check_output_file(ro / "out.json", overwrite=False),
    ):
        with pytest.raises(ConfigError, match="cannot write in"):
            check()
    output_paths.check_output_location(tmp_path / "new" / "out.json")  # a writable parent: fine
