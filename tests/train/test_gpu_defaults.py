"""GPU defaults, tested without a GPU: pinned batches, TF32 selection, FSDP2's bf16 mixed-precision policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin

from vitkit import hardware
from vitkit.data.loader import Batch
from vitkit.train.parallel import fsdp_mixed_precision


def test_dataloader_pinning_reaches_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader(pin_memory=True) pins a custom batch only through its pin_memory() method; without one the
    batch stayed in pageable memory and every non_blocking copy to the GPU was synchronous."""
    pinned: list[torch.Tensor] = []

    def fake_pin(t: torch.Tensor, *args: object) -> torch.Tensor:  # no accelerator here to pin for
        out = t.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    batch = Batch(torch.zeros(2, 3, 4, 4), torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([True, False]))
    out = dataloader_pin(batch)
    assert isinstance(out, Batch)
    assert {id(t) for t in (out.images, out.labels, out.indices, out.valid)} == {id(t) for t in pinned}
    assert torch.equal(out.labels, batch.labels) and torch.equal(out.valid, batch.valid)  # type: ignore[arg-type]


@pytest.mark.parametrize(("capability", "expected"), [((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_tf32_on_gpus_that_have_it(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert hardware.has_tf32("cuda:0") is expected
    assert hardware.has_tf32("cpu") is False


def test_tf32_false_is_full_fp32_and_both_are_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainConfig.tf32: True selects TF32 matmuls on an Ampere GPU (CUDA faked), False full fp32 for matmuls and
    cuDNN convolutions on any device; restore_tf32 puts back what was there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    start = torch.get_float32_matmul_precision()
    before = hardware.use_tf32(torch.device("cuda", 0))
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    hardware.restore_tf32(before)
    assert torch.get_float32_matmul_precision() == start == "highest"
    before = hardware.use_tf32(torch.device("cuda", 0), enabled=False)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    hardware.restore_tf32(before)
    assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == start


def test_fsdp_bf16_policy_computes_in_bf16_and_reduces_in_fp32() -> None:
    policy = fsdp_mixed_precision("bf16", torch.device("cuda", 0))
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    for precision, device in (("fp32", torch.device("cuda", 0)), ("bf16", torch.device("cpu"))):
        policy = fsdp_mixed_precision(precision, device)
        assert policy.param_dtype is None and policy.reduce_dtype is None  # full precision


def test_precision_auto_is_bf16_autocast_on_a_gpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """--precision auto: bf16 autocast on a CUDA GPU computing bf16 (CUDA faked: the choice alone), fp32 on a GPU
    without it and on the CPU whatever its instructions; an explicit choice is kept."""
    from vitkit.train.trainer import train_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512_bf16"})
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert train_precision("auto", cuda) == "bf16" and train_precision("auto", cpu) == "fp32"
    assert train_precision("fp32", cuda) == "fp32" and train_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert train_precision("auto", cuda) == "fp32"


def test_precision_auto_trains_in_fp32_on_the_cpu(tmp_path: Path) -> None:
    """The resolved precision is what the run computes in: "auto" on the CPU equals an fp32 run, step for step."""
    from train_helpers import tiny_config

    from vitkit.train import Trainer, train

    cfg = tiny_config(**{"steps": 2, "epochs": None, "device": "cpu", "data.val_split": None})
    with Trainer(cfg.override(precision="auto"), tmp_path / "probe", progress=False) as t:
        assert t.precision == "fp32"
    auto = train(cfg.override(precision="auto"), tmp_path / "auto", progress=False)
    fp32 = train(cfg, tmp_path / "fp32", progress=False)
    assert [r["loss"] for r in auto.steps] == [r["loss"] for r in fp32.steps]
