from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitkit
from helpers import randomize_
from vitkit.checkpoints import detect_format, load_checkpoint
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError


def test_round_trip_with_metadata(tmp_path: Path) -> None:
    model = randomize_(vitkit.create_model("Ti/16", image_size=(32, 48), num_classes=3, pos_embed="sincos2d"))
    pre = Preprocess(image_size=(32, 48), mean=IMAGENET_MEAN, std=IMAGENET_STD, resize="crop", crop_pct=0.875)
    vitkit.save_pretrained(model, tmp_path / "m", preprocess=pre, class_names=["a", "b", "c"], provenance={"x": 1})
    assert detect_format(tmp_path / "m") == "vitkit"
    loaded = load_checkpoint(tmp_path / "m")
    assert loaded.meta.class_names == ["a", "b", "c"]
    assert loaded.meta.preprocess == pre and loaded.meta.provenance == {"x": 1}
    assert loaded.model.cfg == model.cfg
    x = torch.randn(2, 3, 32, 48)
    torch.testing.assert_close(loaded.model(x), model.eval()(x), rtol=0, atol=0)
    assert loaded.label(1) == "b"


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path: Path) -> None:
    a = vitkit.create_model("Ti/16", image_size=32, num_classes=2)
    b = vitkit.create_model("Ti/16", image_size=32, num_classes=4)
    vitkit.save_pretrained(a, tmp_path / "m")
    vitkit.save_pretrained(b, tmp_path / "m", overwrite=True)
    assert vitkit.load_pretrained(tmp_path / "m").cfg.num_classes == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_errors(tmp_path: Path) -> None:
    model = vitkit.create_model("Ti/16", image_size=32, num_classes=2)
    with pytest.raises(CheckpointError, match="3 class names for a model with 2 classes"):
        vitkit.save_pretrained(model, tmp_path / "m", class_names=["a", "b", "c"])
    vitkit.save_pretrained(model, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        vitkit.load_pretrained(tmp_path / "m")
    cfg = tmp_path / "m" / "config.json"
    doc = json.loads(cfg.read_text())
    doc["model"]["bogus"] = 1
    cfg.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="bogus"):
        vitkit.load_pretrained(tmp_path / "m")
