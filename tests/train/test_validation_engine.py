"""The validation pass of a training run runs on the inference engine's fast path, built from the current weights
(EMA weights when EMA is on) every time: its numbers are a direct fp32 forward of those weights, never of a stale
copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_helpers import tiny_config

from vitkit.data.loader import eval_batches
from vitkit.inference import policy
from vitkit.inference.engine import InferenceEngine
from vitkit.train.trainer import Trainer


def direct(trainer: Trainer, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(top-1, mean loss) of the net with ``weights``, by its own fp32 forward over the validation set."""
    net = type(trainer.net)(trainer.net.cfg)
    net.load_state_dict(weights)
    net.eval()
    correct, loss, n = 0, 0.0, 0
    assert trainer.val_set is not None
    with torch.no_grad():
        for b in eval_batches(trainer.val_set, trainer.preprocess.to_tensor, 512):
            logits = net(b.images)
            correct += int((logits.argmax(-1) == b.labels).sum())
            loss += float(F.cross_entropy(logits, b.labels, reduction="sum"))
            n += len(b.labels)
    return correct / n, loss / n


@pytest.mark.parametrize("ema", [None, 0.9])
def test_validation_sees_the_current_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ema: float | None
) -> None:
    cfg = tiny_config(**{"steps": 6, "epochs": None, "ema_decay": ema})
    monkeypatch.setattr(policy, "VALIDATION_FAST_TOKENS", 0)  # the digits pass is small: the engine anyway
    with Trainer(cfg, tmp_path / "run", progress=False) as t:
        assert t.val_set is not None
        forward, _ = t._validation_forward(t.val_set)
        assert isinstance(getattr(forward, "__self__", None), InferenceEngine)
        seen = []
        for step, micro in zip(range(6), t.loader.epoch(0, 0), strict=False):
            t.train_step(micro)
            if step in (2, 5):
                got = t.evaluate()
                now = {k: v.detach().clone() for k, v in (t.ema.shadow if t.ema else t.net.state_dict()).items()}
                if t.ema is not None:  # the shadow holds the averaged parameters; buffers come from the net
                    now = {**t.net.state_dict(), **now}
                top1, loss = direct(t, now)
                assert got["val_top1"] == pytest.approx(top1, abs=1 / 359 + 1e-9)  # a tie may flip, no more
                assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
                assert got["val_count"] == 359
                seen.append(got["val_loss"])
        assert seen[0] != seen[1]  # trained in between: a new copy of the weights each time
        assert t.net.training  # back to training mode, training kernels untouched


def test_small_validation_passes_keep_the_model(tmp_path: Path) -> None:
    """The default digits job validates 359 images of 5 tokens: packing would cost more than it saves."""
    with Trainer(tiny_config(), tmp_path / "run", progress=False) as t:
        assert t.val_set is not None
        forward, _ = t._validation_forward(t.val_set)
        assert forward is t.forward
