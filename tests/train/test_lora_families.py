"""LoRA on the modern families: the default targets cover SwiGLU's projections and a MAP head's (the same modules
peft's own injection picks from vitkit's config), and ``finetune --method lora`` of a SwiGLU + registers model
trains only the adapters and the head, its loss falls, and the merged model computes what the adapted one does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_helpers import TINY_MODEL

import vitkit
from helpers import randomize_, rel_err
from vitkit import load_checkpoint
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.configs import finetune_config
from vitkit.models.lora import LoraLinear, LoraSpec, adapted_layers, add_lora
from vitkit.train import train
from vitkit.train.state import list_states, read_state

BASE = {"image_size": 16, "patch_size": 8, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 24}
FAMILY = {"mlp": "swiglu", "num_registers": 4, "layer_scale": 0.5}  # DINOv2-giant's block, with registers


@pytest.mark.parametrize(
    ("kw", "extra"),
    [
        (FAMILY, set()),
        ({"classifier": "map", "class_token": False, "gelu": "tanh"},
         {"attn_pool.q", "attn_pool.kv", "attn_pool.proj", "attn_pool.mlp.fc1", "attn_pool.mlp.fc2"}),
    ],
)  # fmt: skip
def test_default_targets_cover_swiglu_and_the_map_head_as_peft_does(kw: dict[str, Any], extra: set[str]) -> None:
    peft = pytest.importorskip("peft")
    blocks = {f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    ours = add_lora(vitkit.create_model("Ti/16", **BASE, **kw, num_classes=3), LoraSpec(rank=2))
    assert {name for name, _ in adapted_layers(ours)} == blocks | extra
    if kw.get("mlp") == "swiglu":  # fc1 holds SwiGLU's gate and up projections stacked: both adapted
        fc1 = ours.blocks[0].mlp.fc1
        assert isinstance(fc1, LoraLinear) and fc1.out_features == 2 * BASE["mlp_dim"]
    theirs = peft.inject_adapter_in_model(
        LoraSpec(rank=2).peft_config(), vitkit.create_model("Ti/16", **BASE, **kw, num_classes=3)
    )
    peft_names = {n.rsplit(".lora_A", 1)[0] for n, _ in theirs.named_modules() if n.endswith(".lora_A")}
    assert peft_names == blocks | extra


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8 px grayscale model with SwiGLU MLPs, 4 registers and layer scale, in vitkit's format."""
    torch.manual_seed(0)
    model = vitkit.create_model("Ti/16", **TINY_MODEL, **FAMILY, image_size=8, in_channels=1, num_classes=10)
    randomize_(model, std=0.3)  # weights large enough that the class token sees the image
    pre = Preprocess(image_size=8, grayscale=True)
    return vitkit.save_pretrained(model.eval(), tmp_path_factory.mktemp("base") / "m", preprocess=pre)


@pytest.fixture(scope="module")
def brightness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic task as an .npz: dark or bright noise images (2 classes)."""
    rng = np.random.default_rng(0)
    arrays: dict[str, Any] = {"classes": np.asarray(["dark", "bright"])}
    for split, n in (("train", 256), ("test", 64)):
        labels = rng.integers(0, 2, n)
        images = rng.integers(0, 128, (n, 8, 8)) + 112 * labels[:, None, None]
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images.astype(np.uint8), labels
    path = tmp_path_factory.mktemp("data") / "brightness.npz"
    np.savez(path, **arrays)
    return path


def test_lora_finetune_of_swiglu_with_registers(base: Path, brightness: Path, tmp_path: Path) -> None:
    cfg = finetune_config(str(base), str(brightness), "finetune-small", (8, 8), method="lora")
    small = {"data.batch_size": 32, "data.workers": 0, "data.eval_batch_size": 64, "steps": 16}
    small |= {"optim.warmup_steps": 1, "optim.lr": 0.05, "checkpoint_every_steps": 16, "log_every_steps": 1}
    small |= {"aug.crop": "pad", "aug.pad": 1, "aug.flip": False}  # no flips: they would swap the classes
    cfg = cfg.override(**small, **{"adapt.lora_rank": 4, "adapt.save_adapters": True, "adapt.select": False})
    result = train(cfg, tmp_path / "run", progress=False)
    losses = [r["loss"] for r in result.steps]
    print("lora losses", [round(v, 3) for v in losses])
    assert len(losses) == 16 and np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses

    # what the run trained: the adapters (SwiGLU's fc1 and fc2 among them) and the head, nothing else
    state = read_state(list_states(tmp_path / "run" / "checkpoints")[-1][1])[0]
    state = {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}
    start = load_checkpoint(base).model.state_dict()
    for name, value in state.items():
        if ".lora_" in name or name.startswith("head."):
            continue
        assert torch.equal(value, start[name.replace(".base_layer", "")]), name  # frozen: the base's values
    for part in ("mlp.fc1", "mlp.fc2", "attn.qkv"):
        assert state[f"blocks.1.{part}.lora_B.default.weight"].abs().max() > 0, part  # B started at zero

    # the adapted model (unmerged, its LoRA layers' own forward) against the merged checkpoint every tool loads
    unmerged = load_checkpoint(base).model
    unmerged.reset_head(2)
    add_lora(unmerged, LoraSpec(rank=4))
    unmerged.load_state_dict(state)
    merged = load_checkpoint(tmp_path / "run" / "model").model
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    x = torch.randn(16, 1, 8, 8)
    with torch.no_grad():
        want, got = unmerged.eval()(x), merged.eval()(x)
    assert rel_err(got, want) < 1e-5


def test_lora_on_a_map_head_trains_its_adapters() -> None:
    torch.manual_seed(0)
    model = randomize_(vitkit.create_model("Ti/16", **BASE, classifier="map", class_token=False, num_classes=3))
    add_lora(model, LoraSpec(rank=2), seed=0)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    pool = model.attn_pool
    assert pool is not None and isinstance(pool.kv, LoraLinear)
    assert pool.kv.lora_B["default"].weight.grad is not None and pool.kv.lora_B["default"].weight.grad.abs().max() > 0
    assert pool.kv.base_layer.weight.grad is None  # frozen
