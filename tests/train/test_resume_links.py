"""``vitkit train --resume RUN`` never writes through a link planted in the run folder (issue 47, item 2): a
``curves.png`` link to a user's file, a dangling ``config.json`` link pointing out of the run. Refused in one line
naming it, before any training; the user's file unchanged, nothing created outside the run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_helpers import Crash, tiny_config

from helpers import run_cli
from vitkit.train import logs
from vitkit.train.trainer import Trainer


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped at step 12 (after its first epoch's checkpoint)."""
    run = tmp_path_factory.mktemp("runs") / "run"

    def crash(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.step == 12:
            raise Crash

    trainer = Trainer(tiny_config(epochs=2), run, progress=False)
    with pytest.raises(Crash):
        trainer.fit(on_step=crash)
    trainer.close()
    return run


def one_line(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(w in lines[0] for w in words), err


@pytest.mark.parametrize("name", ["curves.png", "config.json", "steps.csv", "tb"])
def test_resume_refuses_a_planted_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, interrupted: Path, name: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    mine = home / "photo.png"
    mine.write_bytes(b"my photo")
    entry = interrupted / name
    saved = entry.read_bytes() if entry.is_file() else None
    aside = tmp_path / "aside"
    if os.path.lexists(entry):
        os.replace(entry, aside)
    # a link to the user's file, and a dangling one out of the run
    for target in (mine, home / "created"):
        entry.symlink_to(target)
        try:
            code, _, err = run_cli(capsys, "train", "--resume", str(interrupted), "--quiet")
        finally:
            entry.unlink()
        one_line(code, err, str(entry), "symbolic link")
    if os.path.lexists(aside):
        os.replace(aside, entry)
    assert mine.read_bytes() == b"my photo" and sorted(p.name for p in home.iterdir()) == ["photo.png"]
    assert saved is None or entry.read_bytes() == saved


def test_logs_refuse_links(tmp_path: Path) -> None:
    """The writers themselves refuse a link planted after the resume's check: the curves, the CSV logs."""
    from vitkit.errors import ConfigError

    mine = tmp_path / "mine.csv"
    mine.write_text("epoch,step\n")
    run = tmp_path / "run"
    run.mkdir()
    logs.append_csv(run / "metrics.csv", {"epoch": 1, "step": 1, "train_loss": 1.0, "val_loss": 1.0, "val_top1": 0.5})
    (run / "curves.png").symlink_to(mine)
    with pytest.raises(ConfigError, match=r"curves\.png: is a symbolic link"):
        logs.plot_curves(run / "metrics.csv", run / "curves.png")
    (run / "steps.csv").symlink_to(mine)
    with pytest.raises(ConfigError, match=r"steps\.csv: is a symbolic link"):
        logs.append_csv(run / "steps.csv", {"epoch": 2, "step": 2})
    assert mine.read_text() == "epoch,step\n"
    (run / "curves.png").unlink()
    logs.plot_curves(run / "metrics.csv", run / "curves.png")
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
