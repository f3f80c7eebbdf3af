"""`vitkit convert` between every pair of formats the model allows, and ONNX export vs onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from helpers import FIXTURES, randomize_, run_cli
from vitkit.checkpoints import detect_format, load_checkpoint
from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

CKPT = FIXTURES / "official_vit_tiny.npz"
TARGETS = {"vitkit": "v", "official": "o.npz", "big_vision": "bv.npz", "hf": "hf", "timm": "t.safetensors"}


def test_convert_official_to_every_format_and_back(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    io = np.load(FIXTURES / "official_vit_tiny.io.npz")
    x = torch.from_numpy(io["inputs_nhwc"]).permute(0, 3, 1, 2)
    for fmt, name in TARGETS.items():
        code, out, err = run_cli(capsys, "convert", str(CKPT), str(tmp_path / name), "--to", fmt)
        assert code == 0, err
        assert "rel err 0," in out or "rel err 0\n" in out, out  # every target holds this model exactly
        assert detect_format(tmp_path / name) == fmt
        with torch.no_grad():
            logits = vitkit.load_pretrained(tmp_path / name)(x).numpy()
        err_rel = np.linalg.norm(logits - io["logits"]) / np.linalg.norm(io["logits"])
        assert err_rel < 1e-5, (fmt, err_rel)  # the official implementation's logits, through every format


def test_convert_keeps_class_names_and_changes_resolution(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = randomize_(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=1, num_classes=2)).eval()
    vitkit.save_pretrained(model, tmp_path / "src", class_names=["cat", "dog"])
    code, _out, err = run_cli(
        capsys, "convert", str(tmp_path / "src"), str(tmp_path / "hf"), "--to", "hf", "--image-size", "48x64",
        "--pos-interpolation", "bicubic",
    )  # fmt: skip
    assert code == 0, err
    loaded = load_checkpoint(tmp_path / "hf")
    assert loaded.meta.class_names == ["cat", "dog"] and loaded.model.cfg.image_size == (48, 64)
    ref = vitkit.load_pretrained(tmp_path / "src", image_size=(48, 64), pos_interpolation="bicubic")
    assert ref.pos_embed is not None and loaded.model.pos_embed is not None
    torch.testing.assert_close(loaded.model.pos_embed, ref.pos_embed, rtol=0, atol=0)


def test_convert_refusal_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = vitkit.create_model("Ti/16", image_size=32, classifier="gap", num_classes=2)
    vitkit.save_pretrained(model, tmp_path / "gap")
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "gap"), str(tmp_path / "hf"), "--to", "hf")
    assert code == 2 and "GAP" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("Ti/16", {"image_size": (32, 48), "patch_size": 8, "depth": 2, "classifier": "gap"}),
        ("R50+B/16", {"image_size": 64, "depth": 1, "hidden_size": 48, "num_heads": 3, "mlp_dim": 96,
                      "resnet_layers": (1, 2)}),
    ],
)  # fmt: skip
def test_onnx_matches_pytorch_in_onnxruntime(tmp_path: Path, name: str, kw: dict[str, object]) -> None:
    model = randomize_(vitkit.create_model(name, num_classes=3, **kw)).eval()
    path = export_onnx(model, tmp_path / "m.onnx", dynamic_batch=True)
    check = validate_onnx(model, path, (1, 4))
    assert check.rel_err < 1e-5, check


def test_export_command_reports_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "export", str(CKPT), str(tmp_path / "m.onnx"), "--image-size", "48")
    assert code == 0, err
    rel = float(out.rsplit("rel err ", 1)[1])
    assert rel < 1e-5 and "(B, 3, 48, 48)" in out
