"""--ema / --no-ema: which weights of a training run get evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli
from vitkit.configs import AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig
from vitkit.errors import CheckpointError
from vitkit.evaluate.weights import load_for_eval
from vitkit.train import train as train_run
from vitkit.train.state import latest_state


def tiny_run(out: Path, ema: bool) -> Path:
    cfg = TrainConfig(
        name="tiny",
        data=DataConfig(source="digits", image_size=(8, 8), batch_size=128, eval_batch_size=512, grayscale=True),
        aug=AugConfig(crop="pad", pad=1, flip=False),
        model=ModelConfig(
            name=None, overrides={"patch_size": 4, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32}
        ),
        optim=OptimConfig(name="adamw", lr=3e-3, weight_decay=0.05, warmup_steps=3),
        steps=6,
        ema_decay=0.9 if ema else None,
        log_every_steps=3,
    )
    return train_run(cfg, out, progress=False).run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"ema": tiny_run(root / "ema", True), "plain": tiny_run(root / "plain", False)}


def state_of(path: Path, weights: str) -> dict[str, torch.Tensor]:
    return load_for_eval(path, weights=weights)[0].model.state_dict()


def test_weights_of_a_run_with_ema(runs: dict[str, Path]) -> None:
    run_dir = runs["ema"]
    saved = load_file(str(run_dir / "model" / "model.safetensors"))
    ckpt = load_file(str(latest_state(run_dir / "checkpoints") / "state.safetensors"))  # type: ignore[operator]
    default, ema, raw = (state_of(run_dir, w) for w in ("default", "ema", "raw"))
    for name, value in saved.items():
        assert torch.equal(default[name], value)  # the run's model/ folder as saved
        assert torch.equal(ema[name], ckpt[f"ema/{name}"])
        assert torch.equal(raw[name], ckpt[f"model/{name}"])
    assert any(not torch.equal(raw[n], ema[n]) for n in saved)  # averaging changed something
    _, note = load_for_eval(run_dir, weights="raw", image_size=16)
    assert note == "raw (non-averaged) weights of training step 6"


def test_run_model_folder_holds_the_ema_weights(runs: dict[str, Path]) -> None:
    saved = load_file(str(runs["ema"] / "model" / "model.safetensors"))
    ema = state_of(runs["ema"], "ema")
    assert all(torch.equal(ema[n], v) for n, v in saved.items())


def test_ema_is_an_error_where_there_is_none(runs: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="trained without EMA"):
        load_for_eval(runs["plain"], weights="ema")
    with pytest.raises(CheckpointError, match="only kept in run folders"):
        load_for_eval(runs["plain"] / "model", weights="raw")


def test_eval_command_with_raw_weights(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, runs: dict[str, Path]
) -> None:
    code, out, err = run_cli(capsys, "eval", str(runs["ema"]), "--data", "digits", "--no-ema", "--out", str(tmp_path))
    assert code == 0 and "raw (non-averaged) weights of training step 6" in err and "top-1" in out
    code, _, err = run_cli(capsys, "fewshot", str(runs["plain"]), "--data", "digits", "--ema", "--shots", "1")
    assert code == 2 and "trained without EMA" in err and len(err.strip().splitlines()) == 1
