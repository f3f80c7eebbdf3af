"""The top-level public API: every advertised name exists and the pieces fit together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vitkit
from helpers import randomize_


def test_model_from_and_predict_read_a_saved_checkpoint(tmp_path: Path, sample_jpeg: Path) -> None:
    """model_from takes a variant name or a checkpoint; predict gives the checkpoint's top-k with its labels."""
    model = randomize_(vitkit.create_model("Ti/16", num_classes=3, image_size=32, depth=1)).eval()
    vitkit.save_pretrained(model, tmp_path / "m", class_names=["cat", "dog", "ship"])
    again = vitkit.model_from(tmp_path / "m")
    assert again.cfg == vitkit.model_from("Ti/16", num_classes=3, image_size=32, depth=1).cfg
    torch.testing.assert_close(again.pos_embed, model.pos_embed, rtol=0, atol=0)
    (pred,) = vitkit.predict(tmp_path / "m", [sample_jpeg], top_k=2)
    x = vitkit.load_checkpoint(tmp_path / "m").meta.preprocess(sample_jpeg)[None]  # (1, 3, 32, 32)
    with torch.no_grad():
        probs, index = model(x).softmax(-1)[0].topk(2)
    assert pred.image == str(sample_jpeg)
    assert [label for label, _ in pred.top] == [["cat", "dog", "ship"][int(i)] for i in index]
    assert [p for _, p in pred.top] == pytest.approx(probs.tolist(), rel=1e-5)


def test_the_public_pieces_compose() -> None:
    test = vitkit.open_dataset("digits", "test")
    assert len(test) == 359
    cfg = vitkit.get_recipe("digits")
    assert isinstance(cfg, vitkit.TrainConfig) and cfg.data.source == "digits"
    model = vitkit.create_model("Ti/16", num_classes=10, image_size=32)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
