"""``vitkit serve --backend``: the served model runs on ONNX Runtime / OpenVINO and answers like PyTorch."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from serve_helpers import image_bytes, make_checkpoint

from vitkit.errors import ConfigError
from vitkit.inference.backends import EngineModel, engine_available
from vitkit.serve.served_model import ServedModel

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve-backends") / "tiny")


@pytest.mark.parametrize(
    ("backend", "precision"), [("onnxruntime", "auto"), ("openvino", "fp32"), ("openvino", "bf16")]
)
def test_served_backend_answers_like_the_pytorch_model(ckpt: Path, backend: str, precision: str) -> None:
    if backend == "openvino" and not engine_available("openvino"):
        pytest.skip("openvino is not installed")
    ref_model = ServedModel.from_checkpoint(ckpt, precision="fp32", fast=False)
    x = torch.stack([ref_model.to_tensor(Image.open(io.BytesIO(image_bytes(s)))) for s in range(8)])
    served = ServedModel.from_checkpoint(ckpt, precision=precision, max_batch=4, backend=backend)
    assert isinstance(served.engine.runner, EngineModel) and served.card()["backend"] == backend
    assert served.precision == ("fp32" if precision == "auto" else precision)  # ONNX Runtime: no bf16
    served.warm_up(4)
    ref, got = ref_model.probabilities(x), served.probabilities(x)
    assert (got - ref).abs().max() < (1e-5 if served.precision == "fp32" else 2e-2)
    assert got.sum(-1).sub(1).abs().max() < 1e-5


def test_backend_errors_are_one_line(ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="--backend onnxruntime --precision bf16: onnxruntime computes in fp32"):
        ServedModel.from_checkpoint(ckpt, precision="bf16", backend="onnxruntime")
    with pytest.raises(ConfigError, match="--backend 'trt'"):
        ServedModel.from_checkpoint(ckpt, backend="trt")
