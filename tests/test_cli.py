"""The command line: in-process for speed, plus one real subprocess for the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import FIXTURES, SRC, run_cli
from vitkit.cli import build_parser, main

CKPT = str(FIXTURES / "official_vit_tiny.npz")


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "usage: vitkit" in out


def test_info_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "info", "B/16")
    assert code == 0 and "86,567,656" in out and "17.56 GMACs = 35.13 GFLOPs" in out
    code, out, _ = run_cli(capsys, "info", "L/16", "--image-size", "384", "--num-classes", "10", "--json")
    doc = json.loads(out)
    assert doc["tokens"] == 577 and doc["config"]["num_classes"] == 10
    assert doc["gflops"] == pytest.approx(2 * doc["gmacs"])
    code, out, _ = run_cli(capsys, "info", CKPT)
    assert code == 0 and "GELU tanh" in out


def test_predict_prints_top_k(capsys: pytest.CaptureFixture[str], sample_jpeg: Path) -> None:
    code, out, err = run_cli(capsys, "predict", "--checkpoint", CKPT, str(sample_jpeg), str(sample_jpeg), "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["top"]) == 5  # the fixture has 5 classes
    probs = [t["prob"] for t in lines[0]["top"]]
    assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0, abs=1e-5)
    code, out, _ = run_cli(capsys, "predict", "-c", CKPT, str(sample_jpeg), "--top-k", "2")
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
    code, _out, err = run_cli(capsys, *[str(sample_jpeg) if a == "IMG" else a for a in argv])
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_corrupt_image_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    code, _, err = run_cli(capsys, "predict", "-c", CKPT, str(bad))
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


# ---- train / finetune -----------------------------------------------------------------------------------

TINY = '{"patch_size": 4, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32}'
TINY_TRAIN = ["--image-size", "8", "--batch-size", "256", "--set", f"model.overrides={TINY}", "--quiet"]


def test_train_then_predict_and_finetune(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--epochs", "2", "--lr", "0.003", "--out", str(run_dir), *TINY_TRAIN)
    assert code == 0, err
    assert "test accuracy:" in out and "/359)" in out and f"run folder: {run_dir}" in out
    assert (run_dir / "model" / "model.safetensors").is_file() and (run_dir / "curves.png").is_file()
    # predict with the run folder: grayscale 8x8 preprocessing and class names come from it
    from PIL import Image

    from vitkit.data.datasets import open_dataset

    img_path = tmp_path / "digit.png"
    open_dataset("digits", "test")[0][0].save(img_path)
    code, out, err = run_cli(capsys, "predict", "-c", str(run_dir), str(img_path), "--json")
    assert code == 0, err
    assert len(json.loads(out)["top"]) == 5
    # fine-tune the run on a 3-class folder at 16 px
    for i, cls in enumerate(["x", "y", "z"]):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for j in range(4):
            Image.new("L", (8, 8), 60 * i + j).save(tmp_path / "data" / cls / f"{j}.png")
    ft = tmp_path / "ft"
    argv = ["finetune", str(run_dir), "--data", str(tmp_path / "data"), "--steps", "2", "--batch-size", "4"]
    code, out, err = run_cli(capsys, *argv, "--image-size", "16", "--out", str(ft), "--quiet")
    assert code == 0, err
    assert f"run folder: {ft}" in out
    cfg = json.loads((ft / "config.json").read_text())
    assert cfg["optim"]["name"] == "sgd" and cfg["model"]["init_from"] == str(run_dir)
    assert json.loads((ft / "model" / "config.json").read_text())["class_names"] == ["x", "y", "z"]
    # resuming a finished run is a no-op that ends at the same step
    code, out, err = run_cli(capsys, "train", "--resume", str(ft), "--quiet")
    assert code == 0 and "(2 steps" in out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--recipe", "cifar-small", "--data", "/nonexistent/data"], "/nonexistent/data: no such file"),
        (["train", "--resume", "/nonexistent/run", "--lr", "1"], "--resume continues a run with its saved config"),
        (["train", "--resume", "/nonexistent/run"], "/nonexistent/run: no training checkpoint"),
        (["train", "--recipe", "nope"], "argument --recipe: invalid choice"),
        (["train", "--data", "my_photos"], "--data my_photos: the default recipe trains a 16 px greyscale ViT"),
        (["train", "--set", "optim.lrr=1"], "unknown config field 'optim.lrr'"),
        (["train", "--set", "oops"], "--set expects KEY=VALUE"),
        (["train", "--model", "B/32"], "not a multiple of patch size 32"),
        (["finetune", "/nonexistent.npz", "--data", "digits"], "/nonexistent.npz: no such file"),
    ],
)
def test_training_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, _out, err = run_cli(capsys, *argv)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """A real process killed with SIGKILL right after a mid-epoch checkpoint; resumed by another process."""
    import signal
    import time

    # bit for bit at a fixed thread count (on a busy machine the count follows the free cores: docs/training.md)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    argv = [sys.executable, "-m", "vitkit", "train", "--epochs", "5", "--quiet", "--set", "checkpoint_every_steps=3"]

    def launch(out: Path, *extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*argv, "--out", str(out), *extra], env=env, stderr=subprocess.PIPE)

    ref = launch(tmp_path / "ref")
    assert ref.wait(timeout=600) == 0
    victim = launch(tmp_path / "cut")
    ckpts = tmp_path / "cut" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        assert victim.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "cut" / "model").exists()  # it really died before the end
    resumed = subprocess.run(
        [sys.executable, "-m", "vitkit", "train", "--resume", str(tmp_path / "cut"), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def logged(run: str) -> list[list[str]]:  # step, loss, lr, grad norm of every logged step (not timings)
        return [row.split(",")[:4] for row in (tmp_path / run / "steps.csv").read_text().splitlines()]

    assert logged("ref") == logged("cut")


@pytest.mark.parametrize("native", [True, False])
def test_train_notes_emulated_bf16(
    native: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from vitkit import hardware

    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": native)
    # the note is about CPUs: the run is pinned to one, whatever else this machine has
    argv = [
        "train",
        "--precision",
        "bf16",
        "--set",
        "device=cpu",
        "--steps",
        "1",
        "--quiet",
        "--out",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("no bf16 instructions" in err) is not native


def test_no_emulated_bf16_note_when_auto_means_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With CUDA present "auto" trains on the GPU, and a CPU without bf16 instructions is no reason for a note
    (CUDA faked: only the decision is under test, nothing runs on it)."""
    import torch

    from vitkit import hardware
    from vitkit.commands.args import note_emulated_bf16

    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": torch.device(device).type == "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    note_emulated_bf16("auto", "advice")
    note_emulated_bf16("cuda", "advice")
    assert capsys.readouterr().err == ""
    note_emulated_bf16("cpu", "advice")
    assert "no bf16 instructions" in capsys.readouterr().err


def test_a_bad_set_value_is_one_line_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "train", "--steps", "1", "--quiet", "--set", "optim.lr=abc")
    assert code == 2
    assert err.strip() == "vitkit train: error: --set optim.lr=abc: expected a number"


def test_every_batch_size_help_states_the_default_the_command_uses() -> None:
    """analyze's --help said 64 (the shared option's) while analyze runs 16 (its set_defaults)."""
    import argparse
    import re

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    seen = 0
    for name, p in sub.choices.items():
        for action in p._actions:
            if "--batch-size" in action.option_strings and action.help:
                stated = re.search(r"\(default (\d+)\)", action.help % {"default": action.default})
                if stated:
                    seen += 1
                    default = p.get_default("batch_size")  # bench takes a list (a sweep)
                    assert [int(stated.group(1))] in (default, [default]), name
    assert seen >= 6  # eval, fewshot, knn, analyze, predict, embed at least
