"""vitkit's LoRA layer against the real peft package (the on-disk format and its loader): the same state-dict
names and shapes, the same A drawn from a seed, adapter_config.json equal to peft's ``LoraConfig.to_dict()`` field
by field, and adapter folders in both directions: vitkit's loaded by peft, and peft's saved adapters loaded by
vitkit, each giving the other's outputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vitkit
from vitkit.checkpoints.loaded import state_digest
from vitkit.checkpoints.lora_format import ADAPTERS, HEAD, PEFT_CONFIG, PEFT_VERSION, adapter_config, save
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.models import create_model
from vitkit.models.lora import LoraSpec, add_lora
from vitkit.models.vit import VisionTransformer

peft = pytest.importorskip("peft")

SPECS = [LoraSpec(), LoraSpec(rank=4, alpha=8.0, dropout=0.1, targets=("qkv", "fc2"))]


def tiny(num_classes: int = 5) -> VisionTransformer:
    torch.manual_seed(0)
    model = create_model("Ti/16", patch_size=4, image_size=16, hidden_size=32, depth=2, num_heads=2, mlp_dim=64,
                         num_classes=num_classes)  # fmt: skip
    nn.init.normal_(model.head.weight, std=0.2)  # a zero head would hide every change of the features
    return model


def peft_adapted(spec: LoraSpec, seed: int) -> nn.Module:
    """``tiny()`` with adapters injected by peft itself from ``seed``."""
    model = tiny()
    torch.manual_seed(seed)
    return peft.inject_adapter_in_model(spec.peft_config(), model)


def randomize_b(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)


@pytest.mark.parametrize("spec", SPECS, ids=["default", "qkv-fc2"])
def test_the_same_names_shapes_and_draw_of_a_as_peft(spec: LoraSpec) -> None:
    theirs = peft_adapted(spec, seed=3).state_dict()
    ours = add_lora(tiny(), spec, seed=3).state_dict()
    assert list(ours) == list(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k  # A: peft's draw from the same seed; B: zero; the base: unchanged
    ours_state = vitkit.models.lora.adapter_state(add_lora(tiny(), spec, seed=3))
    theirs_state = peft.get_peft_model_state_dict(peft_adapted(spec, seed=3))
    assert list(ours_state) == list(theirs_state)
    assert all(torch.equal(ours_state[k], v) for k, v in theirs_state.items())


@pytest.mark.parametrize("spec", SPECS, ids=["default", "qkv-fc2"])
def test_adapter_config_is_peft_s_field_by_field(tmp_path: Path, spec: LoraSpec) -> None:
    """adapter_config.json as vitkit writes it without peft, against ``LoraConfig.to_dict()`` of the installed
    peft (its enums as their string values): every field, and nothing else; the version is the one whose fields
    these are."""
    want = json.loads(json.dumps(spec.peft_config().to_dict(), default=lambda v: getattr(v, "value", str(v))))
    got = adapter_config(spec)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if k != "peft_version":
            assert got[k] == v and type(got[k]) is type(v), k
    assert got["peft_version"] == PEFT_VERSION
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(got))
    read = peft.LoraConfig.from_pretrained(str(tmp_path)).to_dict()
    assert {**read, "peft_version": None} == {**spec.peft_config().to_dict(), "peft_version": None}


def adapter_folder(tmp_path: Path, spec: LoraSpec) -> tuple[Path, VisionTransformer, VisionTransformer]:
    """A base checkpoint and an adapter folder vitkit wrote over it: (folder, the base, the adapted model)."""
    base = tiny()
    base_dir = vitkit.save_pretrained(base, tmp_path / "base", preprocess=Preprocess(image_size=16))
    digest = state_digest(vitkit.load_checkpoint(base_dir).model.state_dict())
    adapted = add_lora(copy.deepcopy(base), spec, seed=1)
    randomize_b(adapted)
    folder = save(adapted, tmp_path / "adapters", base=str(base_dir), base_digest=digest, spec=spec)
    return folder, base, adapted


@pytest.mark.parametrize("spec", SPECS, ids=["default", "qkv-fc2"])
def test_a_folder_vitkit_writes_loads_with_peft(tmp_path: Path, spec: LoraSpec) -> None:
    """As lora_format's docstring shows: peft's injection from the folder's adapter_config.json and its state-dict
    loader give vitkit's outputs."""
    folder, base, adapted = adapter_folder(tmp_path, spec)
    theirs = peft.inject_adapter_in_model(peft.LoraConfig.from_pretrained(str(folder)), copy.deepcopy(base))
    result = peft.set_peft_model_state_dict(theirs, load_file(str(folder / ADAPTERS)))
    assert not result.unexpected_keys
    theirs.load_state_dict(load_file(str(folder / HEAD)), strict=False)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = adapted.eval()(x)
        assert torch.equal(theirs.eval()(x), want)  # the same layers, the same ops
        torch.testing.assert_close(vitkit.load_checkpoint(folder).model.eval()(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=["default", "qkv-fc2"])
def test_adapters_peft_saves_load_into_vitkit(tmp_path: Path, spec: LoraSpec) -> None:
    """Adapters made and saved by peft's own API (its injection, ``get_peft_model_state_dict``,
    ``LoraConfig.save_pretrained``) in place of vitkit's files: the folder loads with vitkit (merged, as every
    command loads it) and gives peft's model's outputs."""
    folder, base, _ = adapter_folder(tmp_path, spec)
    theirs = peft.inject_adapter_in_model(spec.peft_config(), copy.deepcopy(base))
    randomize_b(theirs)
    (folder / PEFT_CONFIG).unlink()
    spec.peft_config().save_pretrained(str(folder))
    save_file(peft.get_peft_model_state_dict(theirs), str(folder / ADAPTERS))
    save_file({k: v for k, v in theirs.state_dict().items() if k.startswith("head.")}, str(folder / HEAD))
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = theirs.eval()(x)
        got = vitkit.load_checkpoint(folder).model.eval()(x)
        unmerged = add_lora(copy.deepcopy(base), spec)
        vitkit.models.lora.load_adapter_state(unmerged, load_file(str(folder / ADAPTERS)), "peft's file")
        assert torch.equal(unmerged.eval()(x), want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
