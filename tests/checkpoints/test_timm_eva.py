"""timm's DINOv3 models (``timm/models/eva.py``: ``vit_*_patch16_dinov3[_qkvb]``) through vitkit's ``timm_eva``
format, against the real ``timm`` package (imported with torchvision stubbed, see timm_real.py; skipped without
timm): tiny random Eva models of each kind the entry points build (plain MLP without qkv bias, q/v bias without key
bias, SwiGLU split and packed, class-token and patch-mean pooling, a classification head) are written as timm writes
them (a hub folder: model.safetensors + config.json with the entry point and model_args), loaded with
``load_checkpoint`` and compared with timm's forward in fp32, at the weights' size and another one (RoPE). vitkit's
own timm export of a DINOv3 model is loaded back into the timm model its config.json names, strictly. Files without
timm's config and the other RoPE kinds are refused in one line (EVA-02, read and written: test_timm_eva02.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from timm_real import import_timm

from helpers import randomize_, rel_err
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
TINY = {"embed_dim": 64, "depth": 2, "num_heads": 2, "img_size": 64}
# name: (entry point, model_args beside TINY, config.json's global_pool)
KINDS: dict[str, tuple[str, dict[str, Any], str]] = {
    "small_token": ("vit_small_patch16_dinov3", {}, "token"),
    "small_avg": ("vit_small_patch16_dinov3", {}, "avg"),
    "qkvb_head": ("vit_small_patch16_dinov3_qkvb", {"num_classes": 5}, "token"),
    "swiglu_split": ("vit_small_plus_patch16_dinov3_qkvb", {}, "token"),
    "swiglu_packed": ("vit_small_plus_patch16_dinov3", {"swiglu_align_to": 0}, "token"),
}


def timm_model(arch: str, args: dict[str, Any], pool: str) -> torch.nn.Module:
    timm = sys.modules["timm"]
    model = timm.create_model(arch, pretrained=False, global_pool=pool, **TINY, **args)
    randomize_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma_1", "gamma_2")):
                p.uniform_(0.5, 1.5)  # layer scale of 1e-5 would make every block nearly the identity
    return model.eval()


def timm_folder(model: torch.nn.Module, arch: str, args: dict[str, Any], pool: str, out: Path) -> Path:
    """A timm hub folder as timm's push_to_hub writes it (the architecture, its args, pretrained_cfg)."""
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    doc = {
        "architecture": arch,
        "num_classes": args.get("num_classes", 0),
        "num_features": TINY["embed_dim"],
        "global_pool": pool,
        "model_args": {**TINY, **args},
        "pretrained_cfg": {"input_size": [3, 64, 64], "interpolation": "bicubic", "crop_pct": 1.0,
                           "crop_mode": "center", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_timm_dinov3_loads_exactly(tmp_path: Path, kind: str) -> None:
    arch, args, pool = KINDS[kind]
    ref = timm_model(arch, args, pool)
    folder = timm_folder(ref, arch, args, pool, tmp_path / "timm")
    assert detect_format(folder) == "timm_eva"
    ckpt = load_checkpoint(folder)
    model, cfg = ckpt.model.eval(), ckpt.model.cfg
    assert cfg.rope == "dinov3" and cfg.num_registers == 4 and cfg.pos_embed == "none"
    assert cfg.classifier == ("token" if pool == "token" else "gap") and cfg.layer_norm_eps == 1e-5
    assert cfg.mlp == ("swiglu" if "swiglu" in kind else "plain") and cfg.qkv_bias == ("qkvb" in arch)
    assert ckpt.meta.preprocess.image_size == (64, 64) and ckpt.meta.preprocess.mean == (0.485, 0.456, 0.406)
    for size in (64, 96):  # the weights' grid and another one: RoPE at any size
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            tokens, theirs_tokens = model.forward_features(x), ref.forward_features(x)
            ours, theirs = model(x), ref(x)
        assert tokens.shape == theirs_tokens.shape
        assert rel_err(tokens, theirs_tokens) <= 1e-5, (kind, size)
        assert rel_err(ours, theirs) <= 1e-5, (kind, size)


@pytest.mark.parametrize("kind", ["qkvb_head", "swiglu_split", "small_avg"])
def test_vitkit_writes_timm_eva_that_timm_loads_strictly(tmp_path: Path, kind: str) -> None:
    arch, args, pool = KINDS[kind]
    ref = timm_model(arch, args, pool)
    model = load_checkpoint(timm_folder(ref, arch, args, pool, tmp_path / "in")).model.eval()
    for out in (tmp_path / "out", tmp_path / "out.safetensors"):
        written = save_checkpoint(model, out, "timm")
        doc = json.loads((written / "config.json").read_text()) if written.is_dir() else None
        if doc is not None:
            timm = sys.modules["timm"]
            back = timm.create_model(doc["architecture"], pretrained=False, **doc["model_args"]).eval()
            back.load_state_dict(load_file(str(written / "model.safetensors")), strict=True)
            x = torch.randn(2, 3, 64, 64)
            with torch.no_grad():
                assert rel_err(back(x), model(x)) <= 1e-5
        again = load_checkpoint(written).model.eval()
        assert again.cfg == model.cfg
        for k, v in model.state_dict().items():
            assert torch.equal(again.state_dict()[k], v), k


def test_a_file_without_its_config_and_the_mixed_rope_are_refused(tmp_path: Path) -> None:
    """(EVA-02's refusals: test_timm_eva02.py.)"""
    ref = timm_model("vit_small_patch16_dinov3", {}, "token")
    bare = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(bare))
    with pytest.raises(CheckpointError, match=r"bare.safetensors: a timm Eva state dict without timm's config\.json"):
        load_checkpoint(bare)
    mixed = timm_folder(ref, "vit_small_patch16_dinov3", {"rope_type": "mixed"}, "token", tmp_path / "mixed")
    doc = json.loads((mixed / "config.json").read_text())
    doc["architecture"] = "vit_base_patch16_rope_mixed_224"
    (mixed / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"with RoPE mixed is not supported"):
        load_checkpoint(mixed)


@pytest.mark.parametrize("arch", ["vit_small_patch16_dinov3_qkvb", "vit_small_plus_patch16_dinov3"])
def test_timm_dinov3_at_its_real_shape(tmp_path: Path, arch: str) -> None:
    """DINOv3-S/16 and S+/16 (12 blocks, 384 wide, 6 heads, SwiGLU in S+) with random weights at 224 px, as the
    hub's timm folders hold them (no model_args: the entry point's own settings)."""
    timm = sys.modules["timm"]
    ref = randomize_(timm.create_model(arch, pretrained=False, global_pool="token"), std=0.02).eval()
    folder = tmp_path / "timm"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": arch, "num_classes": 0, "global_pool": "token"}))
    model = load_checkpoint(folder).model.eval()
    assert model.cfg.depth == 12 and model.cfg.num_heads == 6 and model.cfg.image_size == (224, 224)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) <= 1e-5


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("qkv_bias", r"model_args\.qkv_bias=True, but the weights say False"),
        ("reg_token", r"vit_small_patch16_dinov3 has num_reg_tokens 4, the weights 2"),
        ("act", r"a SwiGLU MLP|mlp\.fc1 has"),
    ],
)
def test_a_damaged_timm_dinov3_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, message: str
) -> None:
    """timm's config and the weights disagreeing (a qkv bias the weights lack), a truncated register tensor, an MLP
    that is neither plain nor SwiGLU: `vitkit info` says it in one line naming the folder, exit 2."""
    from helpers import run_cli

    ref = timm_model("vit_small_patch16_dinov3", {}, "token")
    folder = timm_folder(ref, "vit_small_patch16_dinov3", {}, "token", tmp_path / "timm")
    doc = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    if damage == "qkv_bias":
        doc["model_args"]["qkv_bias"] = True
    elif damage == "reg_token":
        state["reg_token"] = state["reg_token"][:, :2]
    else:
        state["blocks.0.mlp.fc1.weight"] = state["blocks.0.mlp.fc1.weight"][:100]
    (folder / "config.json").write_text(json.dumps(doc))
    save_file(state, str(folder / "model.safetensors"))
    code, _, err = run_cli(capsys, "info", str(folder))
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(folder) in lines[0] and re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("out_name", ["out", "out.safetensors", "out.pth"])
def test_converting_what_timms_eva_cannot_hold_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out_name: str
) -> None:
    """`vitkit convert --to timm_eva` of the paper's ViT (a learned position table, no RoPE), and of a DINOv3 to a
    bare .pth (which cannot carry the RoPE settings): one line naming why, exit 2, nothing written; a file already
    there is left as it was."""
    from helpers import run_cli
    from vitkit import create_model, save_pretrained

    plain = save_pretrained(create_model("Ti/16", image_size=32, depth=1, num_classes=2), tmp_path / "plain")
    ref = timm_model("vit_small_patch16_dinov3", {}, "token")
    dinov3 = timm_folder(ref, "vit_small_patch16_dinov3", {}, "token", tmp_path / "dinov3")
    mine = tmp_path / "mine.pth"
    mine.write_bytes(b"the user's own file")
    for src, why in ((plain, r"timm's DINOv3 has RoPE and no position table"), (dinov3, r"bare \.pth cannot record")):
        if why.startswith("timm") or out_name.endswith(".pth"):
            out = tmp_path / out_name
            code, _, err = run_cli(capsys, "convert", str(src), str(out), "--to", "timm_eva")
            lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:")]
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
            assert re.search(why, lines[0]), lines[0]
            assert not out.exists()
    code, _, err = run_cli(capsys, "convert", str(dinov3), str(mine), "--to", "timm_eva")
    assert code == 2 and "already exists" in err and mine.read_bytes() == b"the user's own file"
