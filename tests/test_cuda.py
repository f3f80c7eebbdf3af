"""vitkit on a CUDA GPU against its own fp32 CPU result and the official fixture (marked ``gpu``: skipped, saying
so, without CUDA; see conftest.py). The training step, resume and DDP/FSDP2 over NCCL are the ``cuda`` cases of
tests/train (``helpers.DEVICES``).

fp32 comparisons run in full fp32 (``helpers.full_fp32``: no TF32 in matmuls or cuDNN convolutions), so the GPU
must reproduce the CPU to fp32 rounding; bf16 to bf16 rounding with the same top-1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from helpers import FIXTURES, full_fp32, official_io, randomize_, rel_err, same_top1_where_decided
from vitkit import optimize_for_inference
from vitkit.cli import main
from vitkit.models import create_model, list_models
from vitkit.models.variants import HYBRIDS

pytestmark = pytest.mark.gpu

CKPT = FIXTURES / "official_vit_tiny.npz"
CUDA = torch.device("cuda", 0)
FP32 = 1e-5  # relative L2 error of fp32 on the GPU against fp32 on the CPU
BF16 = 3e-2


def _small(name: str) -> torch.nn.Module:
    """Every variant at its real width, heads and MLP, two blocks at 4x4 patches (hybrids: their ResNet stem too)."""
    torch.manual_seed(0)
    return randomize_(create_model(name, num_classes=10, image_size=_size(name), depth=2)).eval()


def _size(name: str) -> int:
    return 4 * int(name.rsplit("/", 1)[1])  # 4x4 patches (a hybrid's patch is its stem's stride)


def _images(n: int, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", [*list_models(), *HYBRIDS])
def test_every_variant_forward_on_cuda_equals_the_cpu(name: str) -> None:
    model, x = _small(name), _images(4, _size(name))
    with torch.no_grad(), full_fp32():
        ref = model(x)
        gpu = model.to(CUDA)(x.to(CUDA)).cpu()
    assert rel_err(gpu, ref) < FP32, name


def test_intermediates_on_cuda_equal_the_cpu() -> None:
    """Hidden states and attention probabilities of the explicit path (what vitkit analyze reads)."""
    model, x = _small("S/16"), _images(3)
    with torch.no_grad(), full_fp32():
        ref = model.forward_intermediates(x)
        gpu = model.to(CUDA).forward_intermediates(x.to(CUDA))
    assert rel_err(gpu.logits.cpu(), ref.logits) < FP32
    for a, b in zip(gpu.hidden_states, ref.hidden_states, strict=True):
        assert rel_err(a.cpu(), b) < FP32
    for a, b in zip(gpu.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("compile", [False, True])
def test_fast_path_on_cuda(compile: bool) -> None:
    """optimize_for_inference on a CUDA model: fp32 equals the CPU model to fp32 rounding, pure bf16 to bf16
    rounding with the same top-1 (eager and torch.compile)."""
    model, x = _small("B/16"), _images(8)
    with torch.no_grad():
        ref = model(x)
    gpu_model = model.to(CUDA)
    with full_fp32():
        fp32 = optimize_for_inference(gpu_model, torch.float32, compile=compile)
        out = fp32(x.to(CUDA)).float().cpu()
    assert rel_err(out, ref) < (FP32 if not compile else 1e-4)
    bf16 = optimize_for_inference(gpu_model, torch.bfloat16, compile=compile)
    out = bf16(x.to(CUDA)).float().cpu()
    assert rel_err(out, ref) < BF16 and torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("batch", [4, 64])
def test_the_engine_plan_on_cuda(batch: int) -> None:
    """The GPU plan with compiling (bf16, compiled, CUDA graphs for the small batch, the measured SDPA backend),
    run by the engine, computes the model: bf16 rounding against the fp32 CPU result, the same top-1 wherever
    the fp32 margin exceeds bf16's error (random weights give near-ties, which bf16 may flip)."""
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.inference.engine import InferenceEngine
    from vitkit.inference.policy import plan_engine

    model, x = _small("B/16"), _images(batch)
    with torch.no_grad():
        ref = model(x)
    plan = plan_engine("auto", "torch", CUDA, batch_size=batch, compile=True)
    engine = InferenceEngine(model, Preprocess(image_size=x.shape[-1]), batch_size=batch, plan=plan)
    assert plan.compile and engine.attention in plan.sdpa_candidates
    for _ in range(3):  # CUDA graphs record on the first calls and replay after
        out = engine.logits(x)
    assert rel_err(out, ref) < BF16
    same_top1_where_decided(out, ref, BF16)


def test_official_fixture_on_cuda() -> None:
    """The official Flax model's logits, reproduced on the GPU (the CPU reaches ~4e-7)."""
    x, ref = official_io()
    model = vitkit.load_pretrained(CKPT).to(CUDA)
    with torch.no_grad(), full_fp32():
        assert rel_err(model(x.to(CUDA)).cpu().numpy(), ref) < FP32


@pytest.mark.parametrize("size", [(32, 48), (64, 24)])
def test_resampled_position_grid_on_cuda(size: tuple[int, int]) -> None:
    """A checkpoint loaded at a new resolution runs on the GPU as on the CPU, and so does resampling on the fly
    (another input size in forward: the grid is interpolated on the GPU)."""
    model = vitkit.load_pretrained(CKPT, image_size=size)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2))
    other = torch.randn(2, 3, 40, 56, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), full_fp32():
        ref, ref_dynamic = model(x), model(other)
        model.to(CUDA)
        assert rel_err(model(x.to(CUDA)).cpu(), ref) < FP32
        assert rel_err(model(other.to(CUDA)).cpu(), ref_dynamic) < FP32


@pytest.mark.parametrize("task", ["inference", "train"])
def test_bench_on_cuda(task: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`vitkit bench --device cuda` runs end to end and says which GPU it measured (no timing asserted)."""
    out = tmp_path / "bench.json"
    argv = ["bench", "Ti/16", "--image-size", "32", "--batch-size", "4", "--repeats", "2", "--no-latency"]
    assert main([*argv, "--task", task, "--device", "cuda", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["results"]
    assert rows and all(np.isfinite(r["img_per_s"]) and r["img_per_s"] > 0 for r in rows)
    assert torch.cuda.get_device_name(0) in json.dumps(result)
    capsys.readouterr()


def test_fp8_engine_on_cuda() -> None:
    """--precision fp8 on a GPU with fp8 tensor cores (skipped, saying why, on older ones): the blocks' GEMMs in
    e4m3 against the fp32 CPU model, within fp8's error and with the same top-1 wherever decided."""
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.inference.engine import InferenceEngine
    from vitkit.inference.fp8 import fp8_unsupported

    reason = fp8_unsupported(CUDA)
    if reason:
        pytest.skip(reason)
    model, x = _small("B/16"), _images(64)
    with torch.no_grad():
        ref = model(x)
    eng = InferenceEngine(model, Preprocess(image_size=64), precision="fp8", device=CUDA, batch_size=64)
    out = eng.logits(x)
    assert rel_err(out, ref) < 0.2  # random weights at B/16's width: 0.126 on an H100 (0.093 on the CPU)
    same_top1_where_decided(out, ref, 0.2)
