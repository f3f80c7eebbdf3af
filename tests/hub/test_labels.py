"""Class names: shipped ImageNet names for Google's 1000-way heads, kept through load, convert and export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import randomize_, run_cli
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.models import create_model


@pytest.fixture
def imagenet_npz(tmp_path: Path) -> Path:
    """A small official-layout .npz with a 1000-way head whose bias makes class 207 win on any image."""
    model = randomize_(create_model("Ti/16", image_size=32, num_classes=1000, gelu="tanh"), std=0.02)
    with torch.no_grad():
        model.head.bias[207] = 50.0
    return save_checkpoint(model, tmp_path / "vit.npz", "official")


def test_predict_prints_imagenet_names(
    capsys: pytest.CaptureFixture[str], imagenet_npz: Path, sample_jpeg: Path
) -> None:
    code, out, _ = run_cli(capsys, "predict", "-c", str(imagenet_npz), str(sample_jpeg), "--top-k", "1")
    assert code == 0 and "1. golden retriever" in out
    loaded = load_checkpoint(imagenet_npz)
    assert "imagenet-1k" in loaded.meta.provenance["class_names"]


@pytest.mark.parametrize("fmt", ["vitkit", "hf", "timm"])
def test_names_survive_convert(
    capsys: pytest.CaptureFixture[str], imagenet_npz: Path, tmp_path: Path, fmt: str
) -> None:
    out = tmp_path / ("out.safetensors" if fmt == "timm" else "out")
    code, _, err = run_cli(capsys, "convert", str(imagenet_npz), str(out), "--to", fmt)
    assert code == 0, err
    names = load_checkpoint(out).meta.class_names
    assert names is not None and len(names) == 1000 and names[207] == "golden retriever"
    if fmt == "hf":
        assert json.loads((out / "config.json").read_text())["id2label"]["207"] == "golden retriever"


def test_custom_names_survive_convert_and_export(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    model = randomize_(create_model("Ti/16", image_size=32, num_classes=3))
    src = save_checkpoint(model, tmp_path / "src", "vitkit", class_names=["ant", "bee", "cow"])
    for fmt, out in (("hf", tmp_path / "hf"), ("timm", tmp_path / "t.safetensors"), ("vitkit", tmp_path / "v")):
        assert run_cli(capsys, "convert", str(src), str(out), "--to", fmt)[0] == 0
        assert load_checkpoint(out).meta.class_names == ["ant", "bee", "cow"], fmt
    code, _, err = run_cli(capsys, "export", str(tmp_path / "hf"), str(tmp_path / "m.onnx"))
    assert code == 0, err
    meta = ort.InferenceSession(str(tmp_path / "m.onnx")).get_modelmeta().custom_metadata_map
    assert json.loads(meta["class_names"]) == ["ant", "bee", "cow"]
    assert json.loads(meta["preprocess"])["image_size"] == [32, 32]
