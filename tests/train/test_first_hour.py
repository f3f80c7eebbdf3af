"""A new user's first hour with train and finetune (issue 48, items 2, 3, 4 and 6): a run stopped before its first
checkpoint restarts in place with the command the refusal names; a run refused for its data leaves no folder
behind (only what it wrote goes); a resolution the patch does not divide is one line naming --image-size; and
``finetune --skip-bad`` skips an empty class folder as ``train --skip-bad`` does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image
from train_helpers import Crash, assert_same_weights, tiny_config, weights

from helpers import run_cli
from vitkit.checkpoints import vitkit_format
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, DataError
from vitkit.models import create_model
from vitkit.train import Trainer, train
from vitkit.train.state import list_states

TINY = {"patch_size": 4, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32}


def _folder(root: Path, classes: tuple[str, ...] = ("a", "b", "c"), n: int = 4) -> Path:
    for i, c in enumerate(classes):
        (root / "train" / c).mkdir(parents=True)
        for j in range(n):
            Image.new("RGB", (12, 12), (70 * i + 5 * j, 40, 0)).save(root / "train" / c / f"{j}.png")
    return root


def _checkpoint(path: Path) -> Path:
    model = create_model("Ti/16", image_size=16, num_classes=3, **TINY)
    return vitkit_format.save(model, path, preprocess=Preprocess(image_size=(16, 16)))


def test_a_run_stopped_before_its_first_checkpoint_restarts_with_the_command_the_refusal_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(**{"steps": 4, "epochs": None, "data.val_split": None})
    ref = train(cfg, tmp_path / "ref", progress=False)
    cut = tmp_path / "cut"
    trainer = Trainer(cfg, cut, progress=False)

    def stop(t: Trainer, rec: dict[str, float]) -> None:
        if t.step == 2:
            raise Crash  # as Ctrl-C or a kill: before any training state (the first is at the epoch's end)

    with pytest.raises(Crash):
        trainer.fit(on_step=stop)
    trainer.close()
    assert (cut / "config.json").is_file() and list_states(cut / "checkpoints") == []
    capsys.readouterr()
    # the same command again is refused, naming a command that works
    with pytest.raises(ConfigError, match=re.escape(f"vitkit train --resume {cut}")) as refusal:
        train(cfg, cut, progress=False)
    advice = str(refusal.value).split("continue it with: ")[1].split(" (")[0]
    code, out, err = run_cli(capsys, *advice.split()[1:], "--quiet")
    assert code == 0, err
    assert "stopped before its first checkpoint; starting it again from step 0" in err
    assert "(4 steps" in out
    assert_same_weights(weights(ref.run_dir / "model"), weights(cut / "model"))


def test_a_run_refused_for_its_data_leaves_no_folder_and_the_next_run_gets_the_same_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _folder(tmp_path / "photos")
    (data / "train" / "b" / "README.jpg").write_text("not an image, a text file named .jpg\n")
    cfg = tiny_config(**{"data.source": str(data), "data.grayscale": False, "data.batch_size": 4, "epochs": 1,
                         "data.val_split": None})  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"README\.jpg"):
        train(cfg, progress=False)  # the default folder, runs/tiny
    assert not (tmp_path / "runs").exists()  # the run folder and the runs/ it created: gone
    # a folder the user made, holding their own file: only what the run wrote goes
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError, match=r"README\.jpg"):
        train(cfg, mine, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine\n")
    with pytest.raises(DataError, match=r"README\.jpg"):
        train(cfg, progress=False)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["keep.txt"]
    (data / "train" / "b" / "README.jpg").unlink()
    assert train(cfg, progress=False).run_dir == Path("runs/tiny")  # not runs/tiny-2


def test_finetune_image_size_the_patch_does_not_divide_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, data = _checkpoint(tmp_path / "ck"), _folder(tmp_path / "photos")
    out = tmp_path / "runs" / "x"
    for extra in ([], ["--recipe", "paper-finetune"]):  # the schedule sized by the data, and a named recipe
        argv = ["finetune", str(ckpt), "--data", str(data), "--image-size", "10", "--out", str(out), *extra]
        code, _, err = run_cli(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert "--image-size 10x10: not a multiple of the patch size 4" in lines[0] and "--image-size 8" in lines[0]
        assert not (tmp_path / "runs").exists()


def test_finetune_skip_bad_skips_an_empty_class_folder_as_train_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, data = _checkpoint(tmp_path / "ck"), _folder(tmp_path / "photos")
    (data / "train" / "empty").mkdir()
    argv = ["finetune", str(ckpt), "--data", str(data), "--steps", "1", "--batch-size", "4", "--quiet"]
    code, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "r1"))
    assert code == 2 and "empty class folder" in err and "pass --skip-bad" in err, err
    code, out, err = run_cli(capsys, *argv, "--out", str(tmp_path / "r2"), "--skip-bad")
    assert code == 0, err
    assert "skipped 1 bad item(s)" in err and "empty class folder" in err and "(1 steps" in out
