"""Defaults that must fit the checkpoint and the run (issue 13, items 6 and 7): fine-tuning resolution relative to
the checkpoint's, warm-up shortened with the run, and ``--resume`` refusing an edited config."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from vitkit.cli import main
from vitkit.configs import apply_overrides, get_recipe
from vitkit.configs.overrides import finetune_config, finetune_image_size, shortened_warmup
from vitkit.train.optim import fitted_warmup, lr_at


@pytest.mark.parametrize(
    ("native", "stride", "recipe", "expected"),
    [
        ((224, 224), 16, (384, 384), (384, 384)),  # the paper: 224 -> 384
        ((16, 16), 4, (384, 384), (28, 28)),  # the digits model: not 384 px (9,216 tokens)
        ((384, 384), 16, (384, 384), (384, 384)),  # already fine-tuned: stays
        ((224, 320), 32, (384, 384), (256, 384)),  # aspect kept, capped at 384, rounded to the stride
        ((224, 224), 16, (224, 224), (224, 224)),  # finetune-small keeps the checkpoint's resolution
    ],
)
def test_finetune_resolution_is_relative_to_the_checkpoint(
    native: tuple[int, int], stride: int, recipe: tuple[int, int], expected: tuple[int, int]
) -> None:
    assert finetune_image_size(native, stride, recipe) == expected


def test_warmup_shrinks_with_a_shorter_run() -> None:
    cfg = get_recipe("paper-finetune")
    assert (cfg.steps, cfg.optim.warmup_steps) == (500, 100)
    assert shortened_warmup(cfg, None, 15) == {"optim.warmup_steps": 3, "optim.warmup_epochs": 0.0}
    assert shortened_warmup(cfg, None, 5000) == {}  # longer: the recipe's warm-up stays
    digits = apply_overrides(get_recipe("digits"), {"epochs": 7.0})
    assert digits.optim.warmup_epochs == pytest.approx(0.2)  # 2 of 70 epochs
    assert apply_overrides(get_recipe("digits"), {"steps": 700}).optim.warmup_steps == 20
    lrs = [lr_at(s, base_lr=0.01, total_steps=15, warmup_steps=3, schedule="cosine") for s in range(15)]
    assert max(lrs) == lrs[2] == 0.01 and lrs[-1] < 0.001  # the learning rate decays within the 15 steps


def test_finetune_15_steps_on_a_16px_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--steps", "2", "--out", str(tmp_path / "base"), "--quiet"]) == 0
    notes: list[str] = []
    cfg = finetune_config(str(tmp_path / "base"), "digits", "paper-finetune", notes=notes)
    assert cfg.data.image_size == (28, 28) and "28x28 px" in notes[0] and "16x16" in notes[0]
    capsys.readouterr()
    argv = ["finetune", str(tmp_path / "base"), "--data", "digits", "--recipe", "paper-finetune", "--steps", "15"]
    argv += ["--batch-size", "32"]
    assert main([*argv, "--out", str(tmp_path / "ft"), "--quiet"]) == 0
    assert "note: fine-tuning at 28x28 px" in capsys.readouterr().err
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["data"]["image_size"] == [28, 28] and config["optim"]["warmup_steps"] == 3
    with open(tmp_path / "ft" / "steps.csv") as f:
        lr = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    assert lr[15] < lr[10] < config["optim"]["lr"]

    # editing the run's config and resuming is refused, naming the change
    doc = json.loads((tmp_path / "ft" / "config.json").read_text())
    doc["optim"]["lr"] = 0.5
    (tmp_path / "ft" / "config.json").write_text(json.dumps(doc))
    assert main(["train", "--resume", str(tmp_path / "ft")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json: edited since its checkpoint was written (optim.lr: 0.01 -> 0.5)" in err[0]


def _digit_folder(root: Path, n: int) -> Path:
    """An ImageFolder of ``n`` of scikit-learn's 8x8 digits (classes 0 and 1, as greyscale PNGs), train/ only."""
    from PIL import Image

    from vitkit.data.digits import load_digits_arrays

    images, labels = load_digits_arrays()
    keep = np.flatnonzero(labels < 2)[:n]
    for i in keep:
        path = root / "train" / str(labels[i]) / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((images[i] * 15.9).astype(np.uint8), "L").save(path)
    return root


def test_warmup_fits_the_run_that_happens() -> None:
    assert fitted_warmup(3333, 60, 0.2) == 12  # a fifth of the run
    assert fitted_warmup(12, 60, 0.2) == 12 and fitted_warmup(5, 60, 0.2) == 5  # within it: as given
    assert fitted_warmup(10, 2, 0.2) == 1  # at least one step
    assert fitted_warmup(3333, 60, None) == 3333  # opted out
    for name in ("digits", "cifar-small", "deit-i1k", "plain-vit-s16", "paper-finetune", "finetune-small"):
        cfg = get_recipe(name)  # every recipe on its own data keeps its warm-up (epochs: ImageNet's 1251 steps)
        total = cfg.steps or round((cfg.epochs or 0) * 1251)
        warmup = cfg.optim.warmup_steps + round(cfg.optim.warmup_epochs * 1251)
        assert fitted_warmup(warmup, total, cfg.optim.warmup_max_fraction) == warmup, name


def test_recipe_on_32_images_names_batch_size_and_peaks_within_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 25 item 16: plain-vit-s16 (batch 1024, 10k warm-up steps for ImageNet) on 32 images. Without
    --batch-size: one line naming the option. With --batch-size 16 --epochs 30: 60 steps, whose warm-up was
    3,333 of them (the learning rate peaked at 1.8% of its value); now it reaches the recipe's 1e-3 within the
    run and decays after. (A 1-layer model at 32 px: the schedule does not depend on the model's size.)"""
    data = str(_digit_folder(tmp_path / "digits", 32))
    small = ["--image-size", "32", "--set", "model.overrides.depth=1", "--precision", "fp32", "--workers", "0"]
    argv = ["train", "--recipe", "plain-vit-s16", "--data", data, *small, "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size" in err[0] and "32 images" in err[0], err
    assert "choose --batch-size 32 or less" in err[0]
    run = tmp_path / "run"
    argv += ["--batch-size", "16", "--epochs", "30", "--set", "log_every_steps=1", "--out", str(run)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warm-up (3333 steps" in err and "warming up for 12 steps" in err
    with open(run / "steps.csv") as f:
        lr = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    assert len(lr) == 60
    peak = max(lr, key=lambda s: lr[s])
    assert lr[peak] == pytest.approx(1e-3) and peak == 12  # step 12 (1-based) ends the warm-up
    assert lr[60] < 0.05 * lr[peak]  # and the cosine decays within the run


def test_a_run_from_before_the_warmup_cap_resumes_with_its_warmup(tmp_path: Path) -> None:
    """A run whose config has no optim.warmup_max_fraction (written before it existed) ran its warm-up as
    given: --resume keeps that (null), and does not take the edit check's 'added' for an edit."""
    from vitkit.train.state import resume_config

    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--out", str(run), "--quiet"]) == 0
    assert resume_config(run)[0].optim.warmup_max_fraction == 0.2
    states = list(run.glob("checkpoints/*/state.json"))
    assert states
    for path in [run / "config.json", *states]:
        doc = json.loads(path.read_text())
        config = doc.get("config", doc)
        del config["optim"]["warmup_max_fraction"]
        path.write_text(json.dumps(doc))
    assert resume_config(run)[0].optim.warmup_max_fraction is None
