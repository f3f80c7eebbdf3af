"""``--precision fp8``: the blocks' Linears as fp8 GEMMs (``torch._scaled_mm``, rowwise scales). The arithmetic is
checked on the CPU, where PyTorch also runs ``_scaled_mm``, against the fp32 model; the device rule (compute
capability 8.9+) with CUDA faked; the refusal elsewhere as one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import randomize_, rel_err, run_cli, same_top1_where_decided
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.inference import fp8, policy
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.policy import resolve_precision
from vitkit.models import create_model

FP8 = 0.12  # relative L2 error through e4m3 GEMMs against fp32: ~3.7% a layer (3 mantissa bits), 6-9% for
# 1-4 random-weight blocks (bf16: 1%)


def _scaled_mm_runs_here() -> bool:
    try:
        q = torch.zeros(16, 16, dtype=fp8.E4M3)
        torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(not _scaled_mm_runs_here(), reason="this PyTorch has no CPU _scaled_mm")


def test_rowwise_quantisation_keeps_each_rows_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 448e-3, -224e-3]])
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == fp8.E4M3 and scale.shape == (3, 1)
    assert q.float().abs().amax(dim=1).tolist()[::2] == [448.0, 448.0]  # each row's max |x| at e4m3's largest
    assert torch.equal(q[1].float(), torch.zeros(3))  # an all-zero row stays zero
    back = q.float() * scale
    assert torch.allclose(back, x, rtol=2**-4, atol=0)  # 3 mantissa bits: within half an ulp, 1/16 relative


@needs_scaled_mm
@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_fp8_linear_is_the_linear_within_e4m3_rounding(granularity: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    out = fp8.Fp8Linear(layer, granularity)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 48)
    assert rel_err(out.float(), layer(x).detach()) < 5e-2
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.Fp8Linear(nn.Linear(20, 16))


@needs_scaled_mm
def test_the_fp8_model_and_engine_compute_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block Linear of Ti/16 becomes fp8 (the patch embedding and head do not); logits and pre-logits
    features through the engine within fp8's error of the fp32 model, the same top-1 wherever decided."""
    model = randomize_(create_model("Ti/16", num_classes=10, image_size=32, depth=2)).eval()
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, rep = model(x), model.forward_head(model.forward_features(x), pre_logits=True)
    converted = fp8.to_fp8(model)
    kinds = [type(m).__name__ for m in converted.modules()]
    assert kinds.count("Fp8Linear") == 2 * 4 and type(model.blocks[0].mlp.fc1) is nn.Linear  # untouched original
    monkeypatch.setattr(policy, "fp8_unsupported", lambda device: None)  # as on an H100
    eng = InferenceEngine(model, Preprocess(image_size=32), precision="fp8", batch_size=32)
    assert eng.precision == "fp8" and eng.plan.path == "fast" and eng.describe().startswith("fp8 fast path")
    out = eng.forward(x, logits=True, features=True)
    assert out.logits is not None and out.features is not None
    assert rel_err(out.logits, ref) < FP8 and rel_err(out.features, rep) < FP8
    same_top1_where_decided(out.logits, ref, FP8)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


def test_fp8_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, (9, 0))
    assert fp8.fp8_unsupported("cuda") is None and resolve_precision("fp8", "cuda") == "fp8"
    _fake_cuda(monkeypatch, (8, 0))
    reason = "fp8 needs fp8 tensor cores (compute capability 8.9+); NVIDIA A100-SXM4-80GB has 8.0"
    assert fp8.fp8_unsupported("cuda") == reason
    with pytest.raises(ConfigError, match=r"^--precision fp8: .*A100.* has 8\.0$"):
        resolve_precision("fp8", "cuda")
    with pytest.raises(ConfigError, match="--backend torch"):
        resolve_precision("fp8", "cpu", backend="onnxruntime")


def test_fp8_on_the_cpu_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sample_jpeg: Path
) -> None:
    import vitkit

    ckpt = tmp_path / "m"
    vitkit.save_pretrained(create_model("Ti/16", num_classes=3, image_size=32, depth=1), ckpt)
    code, out, err = run_cli(capsys, "predict", "-c", str(ckpt), str(sample_jpeg), "--precision", "fp8")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "vitkit predict: error: --precision fp8: fp8 needs a CUDA GPU with fp8 tensor cores (compute capability "
        "8.9+: Ada, Hopper), not cpu"
    ]
