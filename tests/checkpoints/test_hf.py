"""Hugging Face transformers ViT folders, both ways, against transformers' own ViT on random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from helpers import randomize_, rel_err
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # relative error on logits, both directions


def hf_config(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "intermediate_size": 96,
        "image_size": 32,
        "patch_size": 8,
        "num_labels": 5,
    }
    base.update(kw)
    return transformers.ViTConfig(**base)


def randomize_hf_(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.05)
            if "layernorm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


@pytest.mark.parametrize(
    "kw",
    [
        {},  # HF defaults: exact GELU, eps 1e-12
        {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
        {"hidden_act": "gelu_new", "qkv_bias": False, "layer_norm_eps": 1e-5},
        {"image_size": [32, 48], "num_channels": 1},
    ],
)
def test_hf_to_vitkit_matches_transformers(tmp_path: Path, kw: dict[str, Any]) -> None:
    labels = {"id2label": {i: f"c{i}" for i in range(5)}, "label2id": {f"c{i}": i for i in range(5)}}
    ref = randomize_hf_(transformers.ViTForImageClassification(hf_config(**kw, **labels)))
    ref.save_pretrained(tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    loaded = load_checkpoint(tmp_path / "hf")
    model = loaded.model
    assert loaded.meta.class_names == [f"c{i}" for i in range(5)]
    assert model.cfg.layer_norm_eps == kw.get("layer_norm_eps", 1e-12)
    assert model.cfg.qkv_bias == kw.get("qkv_bias", True)
    size = kw.get("image_size", 32)
    h, w = (size, size) if isinstance(size, int) else size
    x = torch.randn(3, kw.get("num_channels", 3), h, w)
    with torch.no_grad():
        err = rel_err(model(x), ref(pixel_values=x).logits)
    assert err < TOL, err


def test_v5_in_memory_names_load_too(tmp_path: Path) -> None:
    ref = randomize_hf_(transformers.ViTForImageClassification(hf_config()))
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "hf" / "model.safetensors"))
    ref.config.to_json_file(str(tmp_path / "hf" / "config.json"))
    assert any(".layers.0.attention.q_proj" in k for k in load_file(str(tmp_path / "hf" / "model.safetensors")))
    model = vitkit.load_pretrained(tmp_path / "hf")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(model(x), ref(pixel_values=x).logits) < TOL


@pytest.mark.parametrize(
    "kw",
    [{}, {"gelu": "tanh", "layer_norm_eps": 1e-6}, {"qkv_bias": False, "image_size": (32, 48)}],
)
def test_vitkit_to_hf_loads_unchanged_in_transformers(tmp_path: Path, kw: dict[str, Any]) -> None:
    model = randomize_(vitkit.create_model("Ti/16", patch_size=8, depth=2, num_classes=4, **{"image_size": 32, **kw}))
    model.eval()
    pre = Preprocess(image_size=model.cfg.image_size, mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic")
    save_checkpoint(model, tmp_path / "out", "hf", preprocess=pre, class_names=["a", "b", "c", "d"])
    ref, info = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert ref.config.id2label[2] == "c"
    x = torch.randn(2, 3, *model.cfg.image_size)
    with torch.no_grad():
        err = rel_err(ref.eval()(pixel_values=x).logits, model(x))
    assert err < TOL, err
    proc = transformers.ViTImageProcessor.from_pretrained(tmp_path / "out")
    assert list(proc.image_mean) == list(IMAGENET_MEAN) and int(proc.resample) == 3
    # and back: the same function, the same labels and preprocessing
    again = load_checkpoint(tmp_path / "out")
    assert again.meta.class_names == ["a", "b", "c", "d"] and again.meta.preprocess == pre
    torch.testing.assert_close(again.model(x), model(x), rtol=0, atol=0)


def test_sincos_model_exports_as_learned_table(tmp_path: Path) -> None:
    model = randomize_(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=1, num_classes=3))
    sincos = randomize_(
        vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=1, num_classes=3, pos_embed="sincos2d")
    )
    del model
    save_checkpoint(sincos.eval(), tmp_path / "out", "hf")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(ref(pixel_values=x).logits, sincos(x)) < TOL


def test_vit_model_pooler_is_pre_logits(tmp_path: Path) -> None:
    """A ViTModel folder: no classifier (num_classes=0); its tanh pooler is vitkit's pre-logits layer."""
    ref = randomize_hf_(transformers.ViTModel(hf_config(pooler_output_size=24)))
    ref.save_pretrained(tmp_path / "m")
    model = vitkit.load_pretrained(tmp_path / "m")
    assert model.cfg.num_classes == 0 and model.cfg.representation_size == 24
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = ref(pixel_values=x)
        assert rel_err(model(x), out.pooler_output) < TOL
        assert rel_err(model.forward_features(x), out.last_hidden_state) < TOL
    save_checkpoint(model, tmp_path / "again", "hf")
    back = transformers.ViTModel.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert rel_err(back(pixel_values=x).pooler_output, out.pooler_output) < TOL


def test_vit_model_without_pooler(tmp_path: Path) -> None:
    ref = randomize_hf_(transformers.ViTModel(hf_config(), add_pooling_layer=False))
    ref.save_pretrained(tmp_path / "m")
    model = vitkit.load_pretrained(tmp_path / "m")
    assert model.cfg.num_classes == 0 and model.cfg.representation_size is None
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(model(x), ref(pixel_values=x).last_hidden_state[:, 0]) < TOL


def test_classifier_folder_ignores_unused_pooler(tmp_path: Path) -> None:
    ref = randomize_hf_(transformers.ViTForImageClassification(hf_config()))
    ref.save_pretrained(tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["vit.pooler.dense.weight"] = torch.randn(48, 48)
    weights["vit.pooler.dense.bias"] = torch.randn(48)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    loaded = load_checkpoint(tmp_path / "hf")
    assert loaded.meta.provenance["ignored"] == ["vit.pooler.dense.bias", "vit.pooler.dense.weight"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(loaded.model(x), ref(pixel_values=x).logits) < TOL


def test_refusals(tmp_path: Path) -> None:
    ref = randomize_hf_(transformers.ViTForImageClassification(hf_config()))
    ref.save_pretrained(tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["vit.encoder.layer.1.output.dense.bias"]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: vit\.encoder\.layer\.1\.output\.dense\.bias"):
        vitkit.load_pretrained(tmp_path / "hf")
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    doc["hidden_act"] = "relu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="hidden_act 'relu' is not supported"):
        vitkit.load_pretrained(tmp_path / "hf")
    gap = vitkit.create_model("Ti/16", image_size=32, classifier="gap", num_classes=2)
    with pytest.raises(CheckpointError, match="GAP"):
        save_checkpoint(gap, tmp_path / "g", "hf")
    hybrid = vitkit.create_model("R+Ti/16", image_size=64, depth=1, num_classes=2)
    with pytest.raises(CheckpointError, match="hybrid"):
        save_checkpoint(hybrid, tmp_path / "h", "hf")
    assert not (tmp_path / "g").exists() and not (tmp_path / "h").exists()


def test_preprocessor_config_is_read(tmp_path: Path) -> None:
    ref = transformers.ViTForImageClassification(hf_config())
    ref.save_pretrained(tmp_path / "hf")
    proc = transformers.ViTImageProcessor(
        size={"height": 40, "width": 48}, image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6], resample=3
    )
    proc.save_pretrained(tmp_path / "hf")
    pre = load_checkpoint(tmp_path / "hf").meta.preprocess
    assert pre.image_size == (40, 48) and pre.interpolation == "bicubic"
    np.testing.assert_allclose(pre.mean, [0.1, 0.2, 0.3]) and np.testing.assert_allclose(pre.std, [0.4, 0.5, 0.6])
