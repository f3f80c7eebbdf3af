"""What a killed run leaves (a model/ or best/ replace cut between its renames, temporaries, an empty step
folder) is restored or removed when the run is resumed; nothing vitkit did not name is touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_helpers import Crash, tiny_config

from vitkit import fileio
from vitkit.checkpoints import load_checkpoint
from vitkit.train import train
from vitkit.train.trainer import Trainer


def test_resume_cleans_what_a_kill_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(epochs=2)

    def crash(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.step == 12:  # epoch 1 ended at step 11: best/ and a checkpoint exist
            raise Crash

    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    with pytest.raises(Crash):
        trainer.fit(on_step=crash)
    trainer.close()
    root = tmp_path / "run"
    os.replace(root / "best", fileio.temp_path(root / "best", "old"))  # killed between a best/ replace's renames
    assert load_checkpoint(root / "best").model.cfg.depth == 2  # readers fall back meanwhile
    fileio.temp_path(root / "model").mkdir()  # an unfinished model/ write
    (root / "checkpoints" / "step-000000099").mkdir()  # empty step folder (a prune cut short)
    fileio.temp_path(root / "checkpoints" / "step-000000012").mkdir()
    (root / ".my-notes").mkdir()  # not a vitkit name: kept
    capsys.readouterr()
    result = train(resume=root, progress=False)
    assert result.step == 22
    assert "restored best from an interrupted replace" in capsys.readouterr().err
    hidden = sorted(p.name for p in root.rglob(".*"))
    assert hidden == [".my-notes"]
    assert not (root / "checkpoints" / "step-000000099").exists()
    assert load_checkpoint(root / "best").model.cfg.depth == 2
