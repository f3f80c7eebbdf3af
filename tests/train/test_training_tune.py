"""The CPU training step's kernels chosen by measurement (vitkit.train.training_path), timings faked so that the
choice is tested on any CPU; the chosen path still trains."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_helpers import tiny_config

from vitkit.inference import tune as inference_tune
from vitkit.models.kernel_paths import KernelPath
from vitkit.models.vit import Block, VisionTransformer, ViTConfig
from vitkit.train import Trainer
from vitkit.train import kernels as cpu_kernels
from vitkit.train.training_path import choose_training_path

REAL_TIMER = inference_tune.default_timer  # taken at import: --cpu-kind replaces the module's with a fake


class FakeKernels:
    """Stands for the C kernels where this CPU cannot load them (the choice logic only hands them over)."""


def net() -> VisionTransformer:
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=(16, 16), patch_size=4, hidden_size=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    return VisionTransformer(cfg)


def faked(times: Mapping[str, float], calls: list[list[str]]) -> Callable[[Mapping[str, Callable[[], Any]]], dict]:
    def timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        calls.append(list(fns))
        return {k: times.get(k, 10.0) for k in fns}

    return timer


def test_bf16_keeps_the_c_kernels_unless_pytorch_wins_by_min_gain() -> None:
    c = FakeKernels()
    calls: list[list[str]] = []
    kept = choose_training_path(net(), 4, "bf16", True, timer=faked({"c": 10.0, "sdpa": 9.5}, calls), load=lambda: c)
    assert calls == [["c", "explicit", "sdpa"]]  # the built-in first
    assert kept.choice == "c" and kept.kernels is c and kept.explicit and not kept.changed
    won = choose_training_path(net(), 4, "bf16", True, timer=faked({"c": 10.0, "sdpa": 8.0}, calls), load=lambda: c)
    assert won.choice == "sdpa" and won.kernels is None and not won.explicit and won.changed
    assert "sdpa 8.0" in won.describe() and won.source == "measured"
    torch_ops = choose_training_path(
        net(), 4, "bf16", True, timer=faked({"c": 10.0, "explicit": 7.0}, calls), load=lambda: c
    )
    assert torch_ops.choice == "explicit" and torch_ops.kernels is None and torch_ops.explicit


def test_fp32_races_the_explicit_softmax_against_sdpa() -> None:
    c = FakeKernels()
    calls: list[list[str]] = []
    path = choose_training_path(net(), 4, "fp32", True, timer=faked({}, calls), load=lambda: c)
    assert calls == [["explicit", "sdpa"]]
    assert path.choice == "explicit" and path.explicit and path.kernels is c  # today's path, exactly


def test_no_race_where_the_rule_chose_the_fused_kernel_or_the_blocks_are_tiny_or_the_cpu_busy() -> None:
    calls: list[list[str]] = []
    fused = choose_training_path(net(), 4, "bf16", False, timer=faked({}, calls), load=lambda: None)
    assert not calls and not fused.explicit and fused.choice == "sdpa"
    tiny = choose_training_path(net(), 4, "fp32", True, timer=faked({"explicit": 0.3, "sdpa": 0.1}, calls))
    assert tiny.explicit and "too small" in tiny.source and not tiny.times_ms
    busy = choose_training_path(net(), 4, "fp32", True, timer=faked({"sdpa": math.nan}, calls))
    assert busy.explicit and "busy" in busy.source


def test_every_candidate_is_a_real_forward_and_backward() -> None:
    """The real timer on each candidate's block step: each runs (bf16 autocast included) and takes time."""
    seen: dict[str, float] = {}

    def timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        out = REAL_TIMER(fns)
        seen.update(out)
        return {k: v + 5.0 for k, v in out.items()}

    choose_training_path(net(), 2, "bf16", True, timer=timer)
    assert {"explicit", "sdpa"} <= set(seen) and all(v > 0 for v in seen.values())
    if cpu_kernels.load() is not None:
        assert "c" in seen


def test_the_trainer_runs_what_the_race_chose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inference_tune, "default_timer", lambda fns: {k: 5.0 if k == "sdpa" else 10.0 for k in fns})
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (16, 8, 8), dtype=np.uint8)
    labels = np.arange(16) % 4
    data = tmp_path / "one_batch.npz"
    np.savez(data, train_images=images, train_labels=labels, val_images=images, val_labels=labels)
    cfg = tiny_config(
        **{"data.source": str(data), "data.batch_size": 16, "aug.crop": "resize", "aug.pad": 0},
        **{"model.overrides": {"patch_size": 4, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}},
        **{"optim.weight_decay": 0.0, "optim.schedule": "constant", "optim.warmup_steps": 0, "epochs": 60},
    )
    with Trainer(cfg.override(attention="measure"), tmp_path / "run", progress=False) as trainer:
        assert trainer.training_path is not None and trainer.training_path.choice == "sdpa"
        assert not trainer.explicit_attention
        blocks = [m for m in trainer.net.modules() if isinstance(m, Block)]
        assert blocks and all(b.attn.fused and b.path == KernelPath(None) for b in blocks)
        result = trainer.fit()
    assert result.steps[-1]["loss"] < 0.05  # the chosen path still learns (memorises the batch)
    # the default and a kernel set by hand: no race (two runs of one seed must not differ by a timing)
    for attention in ("auto", "explicit"):
        with Trainer(cfg.override(attention=attention), tmp_path / f"run-{attention}", progress=False) as trainer:
            assert trainer.explicit_attention and trainer.training_path is not None
            assert trainer.training_path.source == "as set" and not trainer.training_path.times_ms
