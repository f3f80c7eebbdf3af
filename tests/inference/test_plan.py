"""The fast path's device plan (``vitkit.inference.plan``): the decision for a GPU tested with CUDA faked (the
choice alone), the SDPA measurement and the planned model on the CPU for real."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_, rel_err
from vitkit import hardware
from vitkit.inference import plan as planning
from vitkit.models import create_model


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


@pytest.mark.parametrize("native", [True, False])
def test_cpu_plan_is_the_eager_prepacked_path(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512_bf16"} if native else set())
    p = planning.plan_inference("cpu", "auto", batch_size=4)
    assert p.dtype == (torch.bfloat16 if native else torch.float32)
    assert not p.compile and p.compile_mode is None and p.sdpa_candidates == ()
    assert planning.plan_inference("cpu", "fp32").dtype == torch.float32
    assert planning.plan_inference("cpu", "bf16").dtype == torch.bfloat16


def test_gpu_plan_bf16_compiled_cuda_graphs_for_small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, bf16=True)
    small = planning.plan_inference("cuda:0", "auto", batch_size=4)
    assert small.dtype == torch.bfloat16 and small.compile and small.compile_mode == "reduce-overhead"
    assert small.sdpa_candidates[0] == "flash" and "math" not in small.sdpa_candidates
    big = planning.plan_inference("cuda:0", "auto", batch_size=256)
    assert big.compile and big.compile_mode is None  # torch.compile's default mode
    assert "CUDA graphs" in small.describe() and "bfloat16 on cuda:0" in big.describe()
    fp32 = planning.plan_inference("cuda:0", "fp32", batch_size=256)
    assert fp32.dtype == torch.float32 and "flash" not in fp32.sdpa_candidates and "cudnn" not in fp32.sdpa_candidates


def test_gpu_without_bf16_gets_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, bf16=False)  # pre-Ampere
    p = planning.plan_inference("cuda:0", "auto", batch_size=64)
    assert p.dtype == torch.float32 and p.sdpa_candidates == ("efficient", "math")
    with pytest.raises(ValueError, match="precision must be"):
        planning.plan_inference("cuda:0", "int8")


def test_fastest_sdpa_backend_is_measured_and_drops_what_cannot_run() -> None:
    """On the CPU PyTorch has the math and flash kernels and no cuDNN one: cudnn is left out, the choice is the
    fastest measured (no timing asserted beyond that)."""
    best, timings = planning.fastest_sdpa_backend(
        ("cudnn", "flash", "math"), (2, 3, 17, 64), torch.float32, torch.device("cpu"), repeats=2
    )
    assert set(timings) == {"flash", "math"} and all(t > 0 for t in timings.values())
    assert best == min(timings, key=timings.__getitem__)
    assert planning.fastest_sdpa_backend(("cudnn",), (1, 1, 4, 8), torch.float32, torch.device("cpu")) == (None, {})


def test_sdpa_backend_restricts_the_kernel() -> None:
    q = torch.randn(1, 2, 5, 8)
    with planning.sdpa_backend("math"):
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError), planning.sdpa_backend("cudnn"):  # no cuDNN kernel on the CPU
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with planning.sdpa_backend(None):
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), ref)


def test_optimize_for_device_on_the_cpu_computes_the_model() -> None:
    model = randomize_(create_model("Ti/16", num_classes=10, image_size=32, patch_size=8, depth=2)).eval()
    planned = planning.optimize_for_device(model, "fp32", batch_size=4)
    assert planned.plan.device.type == "cpu" and not planned.plan.compile and planned.attention is None
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(planned(x).float(), model(x)) < 1e-5
