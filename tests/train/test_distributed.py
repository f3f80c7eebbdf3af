"""Multi-process data parallelism: 2 gloo processes (torchrun) against 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import assert_close_weights, tiny_config, weights

from conftest import SRC
from vitkit.train import train

HERE = Path(__file__).parent


def _torchrun(out: Path, strategy: str, nproc: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(HERE / "ddp_run.py"), str(out), strategy], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "losses.json").read_text())


def _single(out: Path) -> dict:
    cfg = tiny_config(**{"ema_decay": 0.9, "aug.randaug_layers": 1, "aug.randaug_magnitude": 5})
    torch.set_num_threads(1)  # the same per-process arithmetic as the workers
    try:
        result = train(cfg, out, progress=False)
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    return {
        "steps": [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in result.steps],
        "top1": result.final_top1,
    }


def _compare(one: dict, two: dict, rtol: float) -> None:
    assert [r["step"] for r in two["steps"]] == [r["step"] for r in one["steps"]]
    assert [r["lr"] for r in two["steps"]] == [r["lr"] for r in one["steps"]]
    np.testing.assert_allclose([r["loss"] for r in two["steps"]], [r["loss"] for r in one["steps"]], rtol=rtol)
    assert two["top1"] == one["top1"]


@pytest.mark.slow
def test_ddp_two_gloo_processes_equal_one_process(tmp_path: Path) -> None:
    one = _single(tmp_path / "one")
    two = _torchrun(tmp_path / "two", "ddp")
    _compare(one, two, rtol=2e-5)
    assert_close_weights(weights(tmp_path / "one" / "model"), weights(tmp_path / "two" / "model"))


@pytest.mark.slow
def test_fsdp2_two_gloo_processes_equal_one_process(tmp_path: Path) -> None:
    one = _single(tmp_path / "one")
    two = _torchrun(tmp_path / "two", "fsdp")
    _compare(one, two, rtol=2e-5)
    assert_close_weights(weights(tmp_path / "one" / "model"), weights(tmp_path / "two" / "model"))
