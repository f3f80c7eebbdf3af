"""``vitkit finetune --sweep lr``: every learning rate of the grid trained on the same split, the one whose kept
weights do best on the held-out split kept (ties: the lower), its choice in the model's provenance, and one-line
refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from test_adapt import _heldout_top1, adapt_config, base, upper  # noqa: F401 (module fixtures)

from helpers import run_cli
from vitkit import load_checkpoint
from vitkit.configs import TrainConfig
from vitkit.train import NonFiniteLossError, sweep
from vitkit.train.logs import read_csv
from vitkit.train.run import RUN_ENTRIES


def test_lr_grid_spans_the_papers_sweep_around_the_runs_lr() -> None:
    assert sweep.lr_grid(0.03) == [0.003, 0.01, 0.03, 0.09]  # the paper's {0.001, ..., 0.03}, shifted up one step
    assert sweep.lr_grid(0.1) == [0.01, 0.03, 0.1, 0.3]
    assert sweep.lr_grid(1e-3) == [1e-4, 3e-4, 1e-3, 3e-3]


def test_the_sweep_trains_every_lr_on_the_same_split_and_keeps_the_best(
    base: Path,  # noqa: F811
    upper: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[TrainConfig] = []
    real = sweep.train

    def spy(cfg: TrainConfig, run_dir: Path, **kw: Any) -> Any:
        seen.append(cfg)
        return real(cfg, run_dir, **kw)

    monkeypatch.setattr(sweep, "train", spy)
    out = tmp_path / "out"
    argv = ["finetune", str(base), "--data", str(upper), "--out", str(out), "--sweep", "lr", "--quiet"]
    code, stdout, err = run_cli(capsys, *argv, "--steps", "4", "--set", "data.workers=0", "--seed", "2")
    assert code == 0, err
    grid = [0.003, 0.01, 0.03, 0.09]  # the default schedule's lr 0.03
    assert [c.optim.lr for c in seen] == grid
    assert all(c.override(**{"optim.lr": 0.03}) == seen[2] for c in seen)  # only the lr differs: same seed, split
    rows = read_csv(out / "sweep.csv")
    assert [r["lr"] for r in rows] == grid and all(r["seconds"] > 0 for r in rows)
    best = max(rows, key=lambda r: (r["val_top1"], -r["lr"]))
    # the output folder is the winner's run: its config, its model measured again on the held-out slice
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == best["lr"]
    assert _heldout_top1(out / "model", upper, seed=2) == pytest.approx(best["val_top1"], abs=1e-9)
    assert read_csv(out / "selection.csv")[-1]["step"] == 4
    assert not (out / "sweep").exists()  # the other runs removed
    prov = load_checkpoint(out).meta.provenance
    assert prov["sweep"]["chosen"] == best["lr"] and prov["sweep"]["grid"] == grid
    assert prov["sweep"]["val_top1"] == {f"{r['lr']:g}": r["val_top1"] for r in rows}
    assert prov["run"] == str(out) and prov["selected_step"] == best["selected_step"]
    assert f"lr {best['lr']:g} chosen on held-out data" in stdout and f"run folder: {out}" in stdout
    code, stdout, err = run_cli(capsys, "info", str(out))
    assert code == 0 and f"lr {best['lr']:g} chosen by validation top-1" in stdout, err
    code, stdout, err = run_cli(capsys, "info", str(out), "--json")
    assert json.loads(stdout)["sweep"]["chosen"] == best["lr"]


@pytest.mark.parametrize(
    ("scores", "kept"),
    [
        ([0.5, 0.6, 0.7, 0.95], 0.09),  # the highest lr does best
        ([0.9, 0.6, 0.7, 0.5], 0.003),  # the lowest
        ([0.5, 0.8, 0.8, None], 0.01),  # a tie: the lower lr; the highest diverged
    ],
)
def test_the_lr_with_the_best_held_out_top1_is_kept(
    base: Path,  # noqa: F811
    upper: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    scores: list[float | None],
    kept: float,
) -> None:
    """Each lr's run says its held-out score; the sweep keeps the one that says the most, whichever it is."""
    real = sweep.train
    by_lr = dict(zip([0.003, 0.01, 0.03, 0.09], scores, strict=True))

    def scored(cfg: TrainConfig, run_dir: Path, **kw: Any) -> Any:
        score = by_lr[cfg.optim.lr]
        if score is None:
            raise NonFiniteLossError("the loss became NaN")
        return dataclasses.replace(real(cfg, run_dir, **kw), best_top1=score)

    monkeypatch.setattr(sweep, "train", scored)
    cfg = adapt_config(base, upper, "full", tmp_path / "cache", steps=2, **{"optim.lr": 0.03})
    swept = sweep.sweep_lr(cfg, tmp_path / "out", progress=False)
    assert swept.lr == kept and swept.result.run_dir == tmp_path / "out"
    assert load_checkpoint(tmp_path / "out").meta.provenance["sweep"]["chosen"] == kept
    assert json.loads((tmp_path / "out" / "config.json").read_text())["optim"]["lr"] == kept
    assert [r["val_top1"] for r in swept.rows] == scores
    assert ("diverged" in swept.summary()) == (None in scores)
    names = {p.name for p in (tmp_path / "out").iterdir()}  # a run's entries and sweep.csv; no sweep/ left
    assert {"checkpoints", "config.json", "model", "selection.csv", "sweep.csv"} <= names
    assert names <= {*RUN_ENTRIES, "sweep.csv"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--method", "linear", "--sweep", "lr"], "--sweep does not apply to --method linear: its L2 strength"),
        (["--sweep", "wd"], "argument --sweep: invalid choice: 'wd'"),
        (["--sweep", "lr", "--set", "adapt.select=false"], "a learning-rate sweep needs a method that trains"),
    ],
)
def test_sweep_refusals_are_one_line(
    base: Path,  # noqa: F811
    upper: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    needle: str,
) -> None:
    code, _, err = run_cli(capsys, "finetune", str(base), "--data", str(upper), "--out", str(tmp_path / "r"), *argv)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_an_output_holding_a_sweep_csv_is_refused_before_any_work(
    base: Path,  # noqa: F811
    upper: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "sweep.csv").write_text("mine\n")
    argv = ["finetune", str(base), "--data", str(upper), "--out", str(tmp_path / "r"), "--sweep", "lr"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "holds 'sweep.csv'" in err and len(err.strip().splitlines()) == 1, err
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["sweep.csv"]
