"""The one policy (``vitkit.inference.policy``): the engine's plan made before any model is built, the decision
for a GPU tested with CUDA faked (the choice alone), training's and bench's defaults, and the SDPA measurement on
the CPU for real."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_, rel_err
from vitkit import hardware
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.inference import policy
from vitkit.inference.engine import InferenceEngine
from vitkit.models import create_model

# the real decisions, taken before --cpu-kind fakes them (conftest) for the tests of what follows from them
REAL = {"bf16_is_faster": policy.bf16_is_faster, "fp32_fast_path_pays": policy.fp32_fast_path_pays}


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, fn in REAL.items():
        monkeypatch.setattr(policy, name, fn)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


@pytest.mark.parametrize("faster", [True, False])
def test_cpu_plan_is_the_eager_prepacked_path(monkeypatch: pytest.MonkeyPatch, faster: bool) -> None:
    monkeypatch.setattr(policy, "bf16_is_faster", lambda device="cpu": faster)
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": True)
    p = policy.plan_engine("auto", "torch", "cpu", batch_size=4, compile=True)  # compiling never pays on a CPU
    assert p.dtype == (torch.bfloat16 if faster else torch.float32) and p.path == "fast" and not p.full_decode
    assert not p.compile and p.compile_mode is None and p.sdpa_candidates == ()
    assert p.describe() == f"--precision auto -> {p.precision}; {p.precision} fast path on cpu"
    ref = policy.plan_engine("fp32")
    assert (ref.path, ref.dtype, ref.full_decode) == ("reference", torch.float32, True)
    assert policy.plan_engine("fp32", fp32_reference=False).path == "fast"
    assert policy.plan_engine("bf16").dtype == torch.bfloat16


def test_auto_on_a_cpu_with_native_but_slower_bf16_plans_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan that ``optimize_for_device`` used (only for a report) took bf16 wherever it is native; the
    engine's measured: bf16 that runs slower than fp32 (AVX512_BF16 without AMX) is not chosen. One policy now."""
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": True)
    monkeypatch.setattr(policy, "bf16_is_faster", lambda device="cpu": False)
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": True)
    p = policy.plan_engine("auto", "torch", "cpu")
    assert (p.precision, p.dtype, p.path) == ("fp32", torch.float32, "fast")


def test_the_plain_path_where_the_fp32_fast_path_does_not_pay(monkeypatch: pytest.MonkeyPatch, measured: None) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", set)  # an AVX2 CPU: no bf16, no AVX-512
    p = policy.plan_engine("auto")
    assert (p.path, p.precision, p.full_decode) == ("plain", "fp32", False)
    assert "slower on this CPU" in p.describe()
    assert policy.plan_engine("fp32").path == "reference"  # an explicit fp32 stays the reference


def test_int8_keeps_its_other_parts_in_bf16_only_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The feature cache's stand-in model ran int8 with bf16 around it on every CPU; the engine (and bench)
    keep fp32 there where bf16 is emulated. One rule now: :func:`policy.fast_dtype`."""
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": False)
    assert policy.plan_engine("int8").dtype == torch.float32 == policy.fast_dtype("int8", "cpu")
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": True)
    assert policy.plan_engine("int8").dtype == torch.bfloat16


def test_gpu_plan_bf16_compiled_cuda_graphs_for_small_batches(monkeypatch: pytest.MonkeyPatch, measured: None) -> None:
    _fake_cuda(monkeypatch, bf16=True)
    small = policy.plan_engine("auto", "torch", "cuda:0", batch_size=4, compile=True)
    assert small.dtype == torch.bfloat16 and small.compile and small.compile_mode == "reduce-overhead"
    assert small.sdpa_candidates[0] == "flash" and "math" not in small.sdpa_candidates
    big = policy.plan_engine("auto", "torch", "cuda:0", batch_size=256, compile=True)
    assert big.compile and big.compile_mode is None  # torch.compile's default mode
    assert "reduce-overhead" in small.describe() and "fast path, torch.compile" in big.describe()
    assert big.describe().endswith("attention: fastest of flash/cudnn/efficient on cuda:0")
    jobs = policy.plan_engine("auto", "torch", "cuda:0", batch_size=256)  # predict/eval: eager, attention measured
    assert not jobs.compile and jobs.sdpa_candidates == big.sdpa_candidates
    fp32 = policy.plan_engine("fp32", "torch", "cuda:0", batch_size=256, fp32_reference=False)
    assert fp32.dtype == torch.float32 and "flash" not in fp32.sdpa_candidates and "cudnn" not in fp32.sdpa_candidates
    assert policy.plan_engine("fp32", "torch", "cuda:0").sdpa_candidates == ()  # the reference: the model itself


def test_gpu_without_bf16_gets_fp32(monkeypatch: pytest.MonkeyPatch, measured: None) -> None:
    _fake_cuda(monkeypatch, bf16=False)  # pre-Ampere
    p = policy.plan_engine("auto", "torch", "cuda:0", batch_size=64)
    assert p.dtype == torch.float32 and p.sdpa_candidates == ("efficient", "math") and p.path == "fast"
    assert policy.train_precision("auto", torch.device("cuda:0")) == "fp32"
    assert policy.bench_precisions("inference", "cuda:0") == ("fp32",)


def test_plans_refuse_what_cannot_run() -> None:
    with pytest.raises(ConfigError, match="--backend 'tensorrt'"):
        policy.plan_engine("auto", "tensorrt")
    with pytest.raises(ConfigError, match="--backend onnxruntime: the engines run on the CPU"):
        policy.plan_engine("fp32", "onnxruntime", torch.device("meta"))
    with pytest.raises(ConfigError, match="--precision 'fp16'"):
        policy.plan_engine("fp16")
    onnx = policy.plan_engine("auto", "onnxruntime", "auto")  # auto: the CPU for the engines; ORT: fp32
    assert (onnx.device.type, onnx.precision, onnx.path, onnx.full_decode) == ("cpu", "fp32", "fast", False)


def test_bench_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": True)
    assert policy.bench_precisions("inference", "cpu") == ("bf16",)
    assert policy.bench_precisions("train", "cpu") == ("bf16-autocast",)


def test_an_engine_runs_the_plan_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job plans first (full or reduced decoding known before anything is built), then builds on the plan."""
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": True)
    model = randomize_(create_model("Ti/16", num_classes=10, image_size=32, patch_size=8, depth=2)).eval()
    plan = policy.plan_engine("fp32", fp32_reference=False)
    eng = InferenceEngine(model, Preprocess(image_size=32), precision="bf16", batch_size=4, plan=plan, tune=False)
    assert eng.plan == plan and eng.precision == "fp32" and eng.runner is not model and not eng.plan.full_decode
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(eng.logits(x), model(x)) < 1e-5


def test_fastest_sdpa_backend_is_measured_and_drops_what_cannot_run() -> None:
    """On the CPU PyTorch has the math and flash kernels and no cuDNN one: cudnn is left out, the choice is the
    fastest measured (no timing asserted beyond that)."""
    best, timings = policy.fastest_sdpa_backend(
        ("cudnn", "flash", "math"), (2, 3, 17, 64), torch.float32, torch.device("cpu"), repeats=2
    )
    assert set(timings) == {"flash", "math"} and all(t > 0 for t in timings.values())
    assert best == min(timings, key=timings.__getitem__)
    assert policy.fastest_sdpa_backend(("cudnn",), (1, 1, 4, 8), torch.float32, torch.device("cpu")) == (None, {})


def test_sdpa_backend_restricts_the_kernel() -> None:
    q = torch.randn(1, 2, 5, 8)
    with policy.sdpa_backend("math"):
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError), policy.sdpa_backend("cudnn"):  # no cuDNN kernel on the CPU
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with policy.sdpa_backend(None):
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), ref)
