"""Small configs for fast trainer tests (a 2-layer, 16-wide ViT on the bundled digits)."""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file

from vitkit.configs import AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig

TINY_MODEL = {"patch_size": 4, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32}


class Crash(Exception):
    """Raised from an ``on_step`` hook to stop a run in-process (for tests that need no real kill)."""


def tiny_config(**changes: Any) -> TrainConfig:
    cfg = TrainConfig(
        name="tiny",
        data=DataConfig(
            source="digits", image_size=(8, 8), batch_size=128, eval_batch_size=512, workers=0, grayscale=True
        ),
        aug=AugConfig(crop="pad", pad=1, flip=False),
        model=ModelConfig(name=None, overrides=dict(TINY_MODEL)),
        optim=OptimConfig(name="adamw", lr=3e-3, weight_decay=0.05, warmup_steps=3),
        epochs=2,
        log_every_steps=1,
    )
    return cfg.override(**changes)


def weights(folder: Any) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Close to float rounding. The key part of each qkv bias is left out: its exact gradient is zero
    (softmax ignores a constant added to every logit of a row), so what it receives is rounding noise, which
    Adam rescales into steps of size ~lr -- it differs with any change of summation order."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if k.endswith("attn.qkv.bias"):
            d = x.shape[0] // 3
            x, y = torch.cat([x[:d], x[2 * d :]]), torch.cat([y[:d], y[2 * d :]])
        torch.testing.assert_close(y, x, rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
