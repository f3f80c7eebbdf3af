"""timm's EVA-02 (``timm/models/eva.py``: ``eva02_{tiny,small,base,large}_patch14_*`` and EVA-CLIP's towers
``eva02_*_clip_*``) through vitkit's ``timm_eva`` format, against the real ``timm`` package (imported with torchvision
stubbed, see timm_real.py; skipped without timm): tiny random EVA-02 models of each kind the entry points build --
fused q/k/v with GluMlp (tiny, small), separate q/k/v with SwiGLU and its sub-LN (base, large), EVA-CLIP's LayerNorm
inside the attention (``scale_attn_inner``), patch-mean pooling with fc_norm and class-token pooling, a
classification head, RoPE's interleaved layout and timm's rotate-half one -- are written as timm's hub folders hold
them, loaded with ``load_checkpoint`` and compared with timm's forward in fp32, at the weights' size and another one
(``dynamic_img_size``: the position table resampled, RoPE recomputed). vitkit's export is loaded back into the timm
model its config.json names, strictly. What vitkit does not compute is refused in one line."""

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

from helpers import randomize_, rel_err, run_cli
from vitkit import optimize_for_inference
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
TINY = {"embed_dim": 64, "depth": 2, "num_heads": 2, "img_size": 56, "dynamic_img_size": True}
# name: (entry point, model_args beside TINY, config.json's global_pool)
KINDS: dict[str, tuple[str, dict[str, Any], str]] = {
    "tiny_avg": ("eva02_tiny_patch14_224", {}, "avg"),
    "small_token_head": ("eva02_small_patch14_336", {"num_classes": 5}, "token"),
    "base_avg_head": ("eva02_base_patch14_448", {"num_classes": 3}, "avg"),
    "large_token": ("eva02_large_patch14_224", {}, "token"),
    "rotate_half": ("eva02_tiny_patch14_224", {"rope_rotate_half": True}, "avg"),
    "no_qkv_bias": ("eva02_base_patch14_224", {"qkv_bias": False, "ref_feat_shape": (8, 12)}, "avg"),
    "clip_base_token": ("eva02_base_patch16_clip_224", {"patch_size": 14}, "token"),  # 14: TINY's 56 px
    "clip_large_avg_head": ("eva02_large_patch14_clip_336", {"num_classes": 4}, "avg"),
}


def timm_model(arch: str, args: dict[str, Any], pool: str, **size: Any) -> torch.nn.Module:
    timm = sys.modules["timm"]
    return randomize_(timm.create_model(arch, pretrained=False, global_pool=pool, **{**TINY, **size, **args})).eval()


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
        "pretrained_cfg": {"input_size": [3, 56, 56], "interpolation": "bicubic", "crop_pct": 1.0,
                           "crop_mode": "squash", "mean": [0.481, 0.458, 0.408], "std": [0.269, 0.261, 0.276]},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_timm_eva02_loads_exactly(tmp_path: Path, kind: str) -> None:
    arch, args, pool = KINDS[kind]
    ref = timm_model(arch, args, pool)
    folder = timm_folder(ref, arch, args, pool, tmp_path / "timm")
    assert detect_format(folder) == "timm_eva"
    ckpt = load_checkpoint(folder)
    model, cfg = ckpt.model.eval(), ckpt.model.cfg
    big = "base" in arch or "large" in arch
    assert cfg.rope == "eva" and cfg.pos_embed == "learned" and cfg.rope_theta == 10000.0
    assert cfg.rope_ref_grid == args.get("ref_feat_shape", (16, 16))
    assert cfg.classifier == ("token" if pool == "token" else "gap") and cfg.fc_norm == (pool == "avg")
    assert cfg.attn_norm == ("clip" in arch)
    assert cfg.mlp == "swiglu" and cfg.mlp_norm == big and cfg.mlp_dim == int(64 * 4 * 2 / 3)
    assert cfg.layer_norm_eps == 1e-6 and cfg.qkv_bias == args.get("qkv_bias", True)
    assert ckpt.meta.preprocess.image_size == (56, 56) and ckpt.meta.preprocess.mean == (0.481, 0.458, 0.408)
    for size in ((56, 56), (84, 70)):  # the weights' grid, and another (position table resampled, RoPE recomputed)
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            tokens, theirs_tokens = model.forward_features(x), ref.forward_features(x)
            ours, theirs = model(x), ref(x)
        assert tokens.shape == theirs_tokens.shape
        assert rel_err(tokens, theirs_tokens) <= 1e-5, (kind, size)
        assert rel_err(ours, theirs) <= 1e-5, (kind, size)
    fast = optimize_for_inference(model, torch.float32)  # the fast path reads the same description
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        assert rel_err(fast(x), ref(x)) <= 1e-5


@pytest.mark.parametrize("arch", ["eva02_small_patch14_224", "eva02_base_patch14_224", "eva02_base_patch16_clip_224"])
def test_timm_eva02_at_its_real_shape(tmp_path: Path, arch: str) -> None:
    """EVA-02-S/14 and B/14 (12 blocks, 384 or 768 wide, MIM towers without a head) with random weights at 224 px, as
    the hub's timm folders hold them (no model_args: the entry point's own settings); EVA-CLIP's B/16 image tower."""
    timm = sys.modules["timm"]
    ref = randomize_(timm.create_model(arch, pretrained=False, num_classes=0), std=0.02).eval()
    folder = tmp_path / "timm"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    pool = "token" if "clip" in arch else "avg"
    (folder / "config.json").write_text(json.dumps({"architecture": arch, "num_classes": 0, "global_pool": pool}))
    model = load_checkpoint(folder).model.eval()
    assert model.cfg.depth == 12 and model.cfg.image_size == (224, 224) and model.cfg.attn_norm == ("clip" in arch)
    assert model.cfg.patch_size == (16 if "patch16" in arch else 14)
    assert model.cfg.classifier == ("token" if pool == "token" else "gap")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) <= 1e-5


@pytest.mark.parametrize("kind", ["tiny_avg", "base_avg_head", "small_token_head", "clip_large_avg_head"])
def test_vitkit_writes_eva02_that_timm_loads_strictly(tmp_path: Path, kind: str) -> None:
    arch, args, pool = KINDS[kind]
    ref = timm_model(arch, args, pool)
    model = load_checkpoint(timm_folder(ref, arch, args, pool, tmp_path / "in")).model.eval()
    for out in (tmp_path / "out", tmp_path / "out.safetensors"):
        written = save_checkpoint(model, out, "timm")  # a RoPE model as timm's Eva
        doc = json.loads((written / "config.json").read_text()) if written.is_dir() else None
        if doc is not None:
            assert doc["architecture"] == "eva02_base_patch14_224"  # width 64 is no entry point's: base, overridden
            timm = sys.modules["timm"]
            back = timm.create_model(doc["architecture"], pretrained=False, **doc["model_args"]).eval()
            back.load_state_dict(load_file(str(written / "model.safetensors")), strict=True)
            x = torch.randn(2, 3, 56, 56)
            with torch.no_grad():
                assert rel_err(back(x), ref(x)) <= 1e-5
        again = load_checkpoint(written).model.eval()
        assert again.cfg == model.cfg
        for k, v in model.state_dict().items():
            assert torch.equal(again.state_dict()[k], v), k


def test_what_vitkit_does_not_compute_is_refused(tmp_path: Path) -> None:
    """qk-norm and post-norm blocks: refused naming the folder
    and what it is. Written to formats that hold no RoPE (the official and big_vision .npz, whose writers see no
    parameter of it; transformers' ViT): refused too, nothing written."""
    from vitkit.checkpoints import big_vision, official
    from vitkit.checkpoints.loaded import export_state

    for name, args, message in (
        ("qk", {"qk_norm": True}, r"timm Eva with qk-norm \(blocks\.0\.attn\.q_norm\.weight\)"),
        ("post", {"use_post_norm": True}, r"model_args\.use_post_norm=True is not supported"),
    ):
        ref = timm_model("eva02_tiny_patch14_224", args, "avg")
        folder = timm_folder(ref, "eva02_tiny_patch14_224", args, "avg", tmp_path / name)
        with pytest.raises(CheckpointError, match=re.escape(str(folder)) + ".*" + message):
            load_checkpoint(folder)
    ref = timm_model("eva02_tiny_patch14_224", {}, "avg")
    model = load_checkpoint(timm_folder(ref, "eva02_tiny_patch14_224", {}, "avg", tmp_path / "ok")).model
    no_rope = r"it computes no RoPE; this model has 'eva'"
    writers = {  # output -> (writer, why)
        "x.npz": (lambda out: official.write(export_state(model), model.cfg, out), no_rope),  # no GELU check first
        "y.npz": (lambda out: big_vision.write(model, out), no_rope),
        "hf": (lambda out: save_checkpoint(model, out, "hf"), r"DINOv2 folder: .* it pools the class token"),
    }
    for out, (write, why) in writers.items():
        with pytest.raises(CheckpointError, match=r"cannot write .*" + why):
            write(tmp_path / out)
        assert not (tmp_path / out).exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("pos_embed", r"pos_embed"),
        ("args", r"has embed_dim 96, the weights 64"),
        ("norm", r"with norm and fc_norm as they are here is not supported"),
        ("inner", r"model_args\.scale_attn_inner=True, but the weights lack blocks\.0\.attn\.norm\.weight"),
    ],
)
def test_a_damaged_timm_eva02_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, message: str
) -> None:
    """A truncated position table, timm's config and the weights disagreeing on the width or on EVA-CLIP's LayerNorm
    inside the attention, both final norms: `vitkit
    info` says it in one line naming the folder, exit 2."""
    ref = timm_model("eva02_tiny_patch14_224", {}, "avg")
    folder = timm_folder(ref, "eva02_tiny_patch14_224", {}, "avg", tmp_path / "timm")
    doc = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    if damage == "pos_embed":
        state["pos_embed"] = state["pos_embed"][:, :7]
    elif damage == "args":
        doc["model_args"]["embed_dim"] = 96
    elif damage == "inner":
        doc["model_args"]["scale_attn_inner"] = True
    else:
        state["norm.weight"] = state["fc_norm.weight"].clone()
    (folder / "config.json").write_text(json.dumps(doc))
    save_file(state, str(folder / "model.safetensors"))
    code, _, err = run_cli(capsys, "info", str(folder))
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(folder) in lines[0] and re.search(message, lines[0]), lines[0]
