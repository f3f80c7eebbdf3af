"""Hugging Face DINOv2 (with and without registers) and DeiT folders, both ways, against transformers' own models
on random weights, at the native size and at other sizes (transformers' interpolate_pos_encoding)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from helpers import rel_err
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # relative error on features and logits, fp32
MEASURED: dict[str, float] = {}  # the largest relative error seen per family (printed with -s)

TINY = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "image_size": 42, "patch_size": 14}
DINO_CASES = [
    ("dinov2", {"mlp_ratio": 2}),
    ("dinov2", {"use_swiglu_ffn": True, "layer_norm_eps": 1e-5, "qkv_bias": False, "layerscale_value": 0.1}),
    ("dinov2", {"hidden_act": "gelu_pytorch_tanh", "mlp_ratio": 3}),
    ("dinov2_with_registers", {"num_register_tokens": 3}),
    ("dinov2_with_registers", {"num_register_tokens": 2, "use_swiglu_ffn": True}),
]
OTHER_SIZES = [(28, 28), (70, 56), (84, 84)]  # smaller (resampling shrinks: antialias matters), non-square, larger


@pytest.fixture(scope="module", autouse=True)
def _report_measured() -> Any:
    yield
    print("\nmax relative error:", {k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})


def randomize_hf_(model: torch.nn.Module) -> torch.nn.Module:
    """Random values everywhere (zero register/distillation tokens and unit layer scales would hide bugs)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.05)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
            if "lambda1" in name:
                p.add_(0.5)
    return model.eval()


def dino_model(model_type: str, kw: dict[str, Any]) -> Any:
    if model_type == "dinov2":
        return randomize_hf_(transformers.Dinov2Model(transformers.Dinov2Config(**{**TINY, **kw})))
    config = transformers.Dinov2WithRegistersConfig(**{**TINY, **kw})
    return randomize_hf_(transformers.Dinov2WithRegistersModel(config))


def _track(name: str, err: float) -> float:
    MEASURED[name] = max(MEASURED.get(name, 0.0), err)
    return err


@pytest.mark.parametrize(("model_type", "kw"), DINO_CASES)
def test_dinov2_matches_transformers(tmp_path: Path, model_type: str, kw: dict[str, Any]) -> None:
    ref = dino_model(model_type, kw)
    ref.save_pretrained(tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    loaded = load_checkpoint(tmp_path / "hf")
    model = loaded.model.eval()
    cfg = model.cfg
    assert cfg.num_registers == kw.get("num_register_tokens", 0)
    assert cfg.mlp == ("swiglu" if kw.get("use_swiglu_ffn") else "plain")
    assert cfg.pos_resample == ("bicubic" if model_type == "dinov2_with_registers" else "bicubic_plain")
    assert loaded.meta.provenance["ignored"] == ["embeddings.mask_token"]
    for size in [(42, 42), *OTHER_SIZES]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            out = ref(pixel_values=x)
            pooled, tokens = model(x), model.forward_features(x)
        assert tokens.shape == out.last_hidden_state.shape
        assert _track(model_type, rel_err(pooled, out.pooler_output)) < TOL, size
        assert _track(model_type, rel_err(tokens, out.last_hidden_state)) < TOL, size


@pytest.mark.parametrize("classes", [5, 0])
def test_deit_matches_transformers(tmp_path: Path, classes: int) -> None:
    config = transformers.DeiTConfig(**TINY, intermediate_size=80, num_labels=max(classes, 1))
    if classes:
        config.id2label, config.label2id = {i: f"c{i}" for i in range(5)}, {f"c{i}": i for i in range(5)}
        ref = randomize_hf_(transformers.DeiTForImageClassificationWithTeacher(config))
    else:
        ref = randomize_hf_(transformers.DeiTModel(config))
    ref.save_pretrained(tmp_path / "hf")
    loaded = load_checkpoint(tmp_path / "hf")
    model = loaded.model.eval()
    assert model.cfg.distilled and model.cfg.num_classes == classes
    assert loaded.meta.class_names == ([f"c{i}" for i in range(5)] if classes else None)
    for size in [(42, 42), *OTHER_SIZES]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            out = ref(pixel_values=x, interpolate_pos_encoding=size != (42, 42))
            ours = model(x)
        # the heads' average (the WithTeacher's logits); without heads, the tokens both heads see
        want = out.logits if classes else out.last_hidden_state[:, :2].mean(dim=1)
        assert _track("deit", rel_err(ours, want)) < TOL, size
    if not classes:
        assert loaded.meta.provenance["ignored"] == ["pooler.dense.bias", "pooler.dense.weight"]


def test_real_shape_dinov2_s14_registers_at_224(tmp_path: Path) -> None:
    start = time.perf_counter()
    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, image_size=518, patch_size=14
    )
    ref = randomize_hf_(transformers.Dinov2WithRegistersModel(config))
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model.eval()
    assert model.cfg.num_registers == 4 and model.cfg.grid_size == (37, 37)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        err = rel_err(model(x), ref(pixel_values=x).pooler_output)
    assert _track("dinov2-S/14-reg4 at 224", err) < TOL
    assert time.perf_counter() - start < 20


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    ("model_type", "kw"), [DINO_CASES[1], DINO_CASES[4], ("deit", {"num_labels": 3}), ("deit", {"num_labels": 0})]
)
def test_round_trip_is_bit_exact(tmp_path: Path, model_type: str, kw: dict[str, Any]) -> None:
    if model_type == "deit":
        config = transformers.DeiTConfig(**TINY, intermediate_size=80, **kw)
        cls = transformers.DeiTForImageClassificationWithTeacher if kw["num_labels"] else transformers.DeiTModel
        ref = randomize_hf_(cls(config))
    else:
        ref = dino_model(model_type, kw)
    ref.save_pretrained(tmp_path / "hf")
    first = load_checkpoint(tmp_path / "hf")
    save_checkpoint(first.model, tmp_path / "out", "hf", meta=first.meta)
    extra = {"add_pooling_layer": False} if type(ref) is transformers.DeiTModel else {}
    again, info = type(ref).from_pretrained(tmp_path / "out", output_loading_info=True, **extra)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = {k: v for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items() if "pooler" not in k}
    if "embeddings.mask_token" in original:  # the masked-modelling token is not kept: written as HF's zeros
        assert not written.pop("embeddings.mask_token").any()
        del original["embeddings.mask_token"]
    _same_tensors(written, original)
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        out, theirs = (
            again.eval()(pixel_values=x, interpolate_pos_encoding=True),
            ref(pixel_values=x, interpolate_pos_encoding=True),
        )
    for field in ("logits", "last_hidden_state", "pooler_output"):
        if getattr(theirs, field, None) is not None and not (field == "pooler_output" and extra):
            assert torch.equal(getattr(out, field), getattr(theirs, field)), field
    second = load_checkpoint(tmp_path / "out")
    _same_tensors(second.model.state_dict(), first.model.state_dict())
    assert second.model.cfg == first.model.cfg


def _sample_photos() -> list[Image.Image]:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    photos = [Image.fromarray(a) for a in sklearn_datasets.load_sample_images().images]
    return photos + [p.transpose(Image.Transpose.TRANSPOSE) for p in photos]  # portrait too


@pytest.mark.parametrize("family", ["dinov2", "deit"])
def test_preprocessing_matches_image_processor(tmp_path: Path, family: str) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    with warnings.catch_warnings():  # "requires torchvision ... falling back to the PIL processor"
        warnings.simplefilter("ignore")
        if family == "dinov2":
            ref = dino_model("dinov2", {"image_size": 112})  # 224 px input: at most twice the model's size
            size: dict[str, int] = {"shortest_edge": 256}
            proc = transformers.BitImageProcessor(
                size=size, crop_size={"height": 224, "width": 224}, resample=3, image_mean=mean, image_std=std
            )
        else:
            ref = randomize_hf_(transformers.DeiTModel(transformers.DeiTConfig(**{**TINY, "image_size": 112})))
            size = {"height": 256, "width": 256}
            proc = transformers.DeiTImageProcessor(
                size=size, crop_size={"height": 224, "width": 224}, resample=3, image_mean=mean, image_std=std
            )
    ref.save_pretrained(tmp_path / "hf")
    proc.save_pretrained(tmp_path / "hf")
    loaded = load_checkpoint(tmp_path / "hf")
    pre = loaded.meta.preprocess
    assert pre.image_size == (224, 224) and pre.interpolation == "bicubic" and pre.mean == mean
    for img in _sample_photos():
        theirs = proc(img, return_tensors="np")["pixel_values"][0]
        levels = np.abs(pre(img).numpy() - theirs) * np.asarray(std)[:, None, None] * 255
        assert levels.max() <= 1 + 1e-4, levels.max()  # within one 8-bit level
    save_checkpoint(loaded.model, tmp_path / "out", "hf", meta=loaded.meta)
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert written["size"] == size and written["crop_size"] == {"height": 224, "width": 224}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = type(proc).from_pretrained(tmp_path / "out")
    img = _sample_photos()[0]
    assert np.array_equal(
        again(img, return_tensors="np")["pixel_values"], proc(img, return_tensors="np")["pixel_values"]
    )


def _edit_config(folder: Path, **changes: Any) -> None:
    doc = json.loads((folder / "config.json").read_text())
    doc.update(changes)
    (folder / "config.json").write_text(json.dumps(doc))


def _one_line_error(folder: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(folder)
    assert "\n" not in str(info.value), str(info.value)


def test_bad_folders_are_one_line(tmp_path: Path) -> None:
    ref = dino_model("dinov2_with_registers", {"num_register_tokens": 3})
    for case in ("hidden", "ratio", "act", "size", "registers", "truncated", "type", "swin"):
        ref.save_pretrained(tmp_path / case)
    _edit_config(tmp_path / "hidden", hidden_size=60)
    _one_line_error(tmp_path / "hidden", "shape mismatches")
    _edit_config(tmp_path / "ratio", mlp_ratio=2)
    _one_line_error(tmp_path / "ratio", r"blocks\.0\.mlp\.fc1\.weight: expected \(96, 48\), got \(192, 48\)")
    _edit_config(tmp_path / "act", hidden_act="relu")
    _one_line_error(tmp_path / "act", "hidden_act 'relu' is not supported")
    _edit_config(tmp_path / "size", image_size=[42, 56])
    _one_line_error(tmp_path / "size", "image_size 42x56 is not supported")
    _edit_config(tmp_path / "registers", num_register_tokens=4)  # config says 4, the weights hold 3
    _one_line_error(tmp_path / "registers", r"reg_token: expected \(1, 4, 48\), got \(1, 3, 48\)")
    weights = load_file(str(tmp_path / "truncated" / "model.safetensors"))
    weights["embeddings.register_tokens"] = weights["embeddings.register_tokens"][:, :2].contiguous()
    save_file(weights, str(tmp_path / "truncated" / "model.safetensors"))
    _one_line_error(tmp_path / "truncated", r"reg_token: expected \(1, 3, 48\), got \(1, 2, 48\)")
    _edit_config(tmp_path / "type", model_type="dinov2")  # registers the config does not have
    _one_line_error(tmp_path / "type", r"unexpected keys: embeddings\.register_tokens")
    _edit_config(tmp_path / "swin", model_type="swin")
    with pytest.raises(CheckpointError, match="model_type 'swin' is not supported"):
        load_checkpoint(tmp_path / "swin", format="hf")


def test_unsupported_heads_and_exports_are_refused(tmp_path: Path) -> None:
    head = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(**TINY, num_labels=2))
    head.save_pretrained(tmp_path / "cls")
    _one_line_error(tmp_path / "cls", "Dinov2ForImageClassification")
    deit = transformers.DeiTForImageClassification(transformers.DeiTConfig(**TINY, intermediate_size=80))
    deit.save_pretrained(tmp_path / "deit")
    _one_line_error(tmp_path / "deit", "DeiTForImageClassification ")
    dino = load_checkpoint(_saved(tmp_path / "d", dino_model("dinov2", {}))).model
    dino.reset_head(3)
    with pytest.raises(CheckpointError, match="Dinov2Model has no classifier"):
        save_checkpoint(dino, tmp_path / "out", "hf")
    assert not (tmp_path / "out").exists()


def _saved(folder: Path, model: Any) -> Path:
    model.save_pretrained(folder)
    return folder
