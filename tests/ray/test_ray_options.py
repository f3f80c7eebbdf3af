"""``--ray``'s argument without Ray installed: a word that is not a Ray address (an image path that ``--ray`` took
as its argument) is one line, exit 2, before anything is read or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_cli


@pytest.mark.parametrize("command", ["embed", "predict"])
def test_a_word_that_is_not_a_ray_address_is_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    argv = ["embed", "model", "--out", str(out)] if command == "embed" else ["predict", "-c", "model"]
    code, _, err = run_cli(capsys, *argv, "--ray", "photos/", "more.jpg")
    assert code == 2
    lines = err.strip().splitlines()
    assert "'photos/' is not a Ray address" in lines[-1] and "--ray" in lines[-1]
    assert out.read_text() == "kept\n"
