"""ONNX export of the modern ViT families (DINOv2 registers + layer scale, DeiT distilled, SigLIP MAP, CLIP, SwiGLU,
DINOv3-style RoPE): a dynamic batch, and onnxruntime's output equals PyTorch's at batch 1 and 3; a transformers
DINOv2-with-registers folder through ``vitkit export`` equals transformers' own pooled output in onnxruntime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vitkit
from helpers import randomize_, rel_err, run_cli
from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TOL = 1e-4  # relative L2 error of onnxruntime's output against PyTorch's, fp32
MEASURED: dict[str, float] = {}  # the largest relative error seen per family (printed with -s)
BASE = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
FAMILIES: dict[str, dict[str, Any]] = {
    "dinov2_reg4": {"num_registers": 4, "layer_scale": 0.5},
    "deit_distilled": {"distilled": True},
    "siglip_map": {"classifier": "map", "class_token": False, "gelu": "tanh"},
    "clip": {"norm_pre": True, "gelu": "quick", "projection_size": 24, "patch_bias": False, "layer_norm_eps": 1e-5},
    "swiglu": {"mlp": "swiglu", "num_registers": 2},
    "dinov3_rope": {"pos_embed": "none", "rope": "dinov3", "num_registers": 4, "layer_scale": 0.5, "key_bias": False},
}


@pytest.fixture(scope="module", autouse=True)
def _report_measured() -> Any:
    yield
    print("\nonnxruntime vs PyTorch, max relative error:", {k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})


def _track(name: str, err: float) -> float:
    MEASURED[name] = max(MEASURED.get(name, 0.0), err)
    return err


@pytest.mark.parametrize("classes", [3, 0])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_exports_with_a_dynamic_batch(tmp_path: Path, family: str, classes: int) -> None:
    torch.manual_seed(0)
    model = randomize_(vitkit.create_model("Ti/16", **BASE, **FAMILIES[family], num_classes=classes)).eval()
    path = export_onnx(model, tmp_path / "m.onnx", dynamic_batch=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # the batch axis is free
    width = classes or model.num_features  # logits, or CLIP's projected embedding / the pooled features
    for b in (1, 3):
        check = validate_onnx(model, path, (b,), seed=b)
        assert _track(family, check.rel_err) < TOL, (b, check)
        x = torch.randn(b, 3, 32, 32)
        got = session.run(None, {"images": x.numpy()})[0]
        with torch.no_grad():
            want = model(x)
        assert got.shape == (b, width)
        assert rel_err(got, want.numpy()) < TOL


def test_transformers_registers_folder_exports_through_the_cli(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, image_size=42, patch_size=14,
        num_register_tokens=4, layerscale_value=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = randomize_(transformers.Dinov2WithRegistersModel(config)).eval()
    ref.save_pretrained(tmp_path / "hf")
    out = tmp_path / "m.onnx"
    code, text, err = run_cli(capsys, "export", str(tmp_path / "hf"), str(out), "--dynamic-batch")
    assert code == 0, err
    assert float(text.rsplit("rel err ", 1)[1]) < TOL, text
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for b in (1, 3):
        x = torch.randn(b, 3, 42, 42)
        with torch.no_grad():
            want = ref(pixel_values=x).pooler_output.numpy()  # transformers' own forward
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        assert _track("hf_dinov2_reg4", rel_err(got, want)) < TOL, b
        assert np.isfinite(got).all()
