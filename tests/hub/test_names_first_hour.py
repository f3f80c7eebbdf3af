"""Checkpoint names as a new user mistypes them (issue 48, items 5 and 10): a mistyped local path is one line at
once (no network), a variant name is refused the same way by every command that needs weights (``vitkit info``
describes it), an unknown variant says so, a misspelt name gets suggestions, and an argument a command does not
know is that command's error."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from helpers import run_cli


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face Hub and downloads must not be asked (they waited ~25 s offline)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the network was asked: {args}")

    resolve_module = importlib.import_module("vitkit.hub.resolve")  # (vitkit.hub.resolve is also the function)
    monkeypatch.setattr(resolve_module, "fetch_hub", refuse)
    monkeypatch.setattr(resolve_module, "download", refuse)


def _one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_a_mistyped_local_path_is_one_line_at_once_with_the_close_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_network: None
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny-full").mkdir(parents=True)
    line = _one_line(*run_cli(capsys, "eval", "runs/tiny-ful", "--data", "digits")[::2])
    assert line.startswith("vitkit eval: error: runs/tiny-ful: no such file or directory (close: runs/tiny-full)")
    assert "download" not in line


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "B/16", "--data", "digits"],
        ["predict", "-c", "B/16", "{image}"],
        ["finetune", "S/16", "--data", "digits"],
        ["download", "ViT-L/16"],
        ["knn", "R50+B/16", "--data", "digits"],
    ],
)
def test_a_variant_name_is_refused_the_same_way_by_every_command_that_needs_weights(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], no_network: None
) -> None:
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    line = _one_line(*run_cli(capsys, *[a.replace("{image}", str(image)) for a in argv])[::2])
    name = next(a for a in argv if "/" in a and a != str(image))
    assert f"{name}: a model variant (an architecture: vitkit info {name} describes it), not a checkpoint" in line
    assert "did you mean" not in line


def test_info_takes_the_variant_and_says_unknown_variant_for_one_that_is_not(
    capsys: pytest.CaptureFixture[str], no_network: None
) -> None:
    code, out, err = run_cli(capsys, "info", "B/16")
    assert code == 0 and "86,567,656" in out, err
    line = _one_line(*run_cli(capsys, "info", "B/61")[::2])
    assert "unknown variant 'B/61'" in line and "multiple" not in line
    code, out, err = run_cli(capsys, "info", "Ti/4", "--image-size", "32")  # another patch with a size it divides
    assert code == 0, err


def test_a_misspelt_name_gets_suggestions(capsys: pytest.CaptureFixture[str], no_network: None) -> None:
    line = _one_line(*run_cli(capsys, "info", "vit-b16")[::2])
    assert "did you mean the model variant B/16 (vitkit info B/16)?" in line
    assert "close: ViT-B_16-i21k" in line


def test_an_argument_a_command_does_not_know_is_that_commands_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(*run_cli(capsys, "eval", "ck", "--data", "digits", "--bogus")[::2])
    assert line == "vitkit eval: error: unrecognized arguments: --bogus (see vitkit eval --help)"
    line = _one_line(*run_cli(capsys, "predict", "-c", "ck", "x.png", "--bogus")[::2])
    assert line.startswith("vitkit predict: error: unrecognized arguments: --bogus")
