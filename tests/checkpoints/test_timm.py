"""timm ViT state dicts. timm cannot be imported here, so the map is proven against a functional
re-statement of timm's VisionTransformer forward (timm/models/vision_transformer.py: _pos_embed, Block with
fused qkv reshaped (B, N, 3, h, d), norm, pool, head), plus exact round trips and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import vitkit
from helpers import randomize_, rel_err
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.checkpoints import timm_format as tf
from vitkit.errors import CheckpointError


def timm_forward(
    sd: dict[str, torch.Tensor], x: torch.Tensor, heads: int, *, no_embed_class: bool = False, pool: str = "token"
) -> torch.Tensor:
    """timm's VisionTransformer.forward for a plain ViT state dict (eval mode, eps 1e-6, exact GELU)."""
    w = sd["patch_embed.proj.weight"]
    D, P = w.shape[0], w.shape[-1]
    x = F.conv2d(x, w, sd["patch_embed.proj.bias"], stride=P).flatten(2).transpose(1, 2)
    cls = sd.get("cls_token")
    if cls is not None and no_embed_class:
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x + sd["pos_embed"]], dim=1)
    elif cls is not None:
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1) + sd["pos_embed"]
    else:
        x = x + sd["pos_embed"]
    B, N, _ = x.shape
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        p = f"blocks.{i}."
        h = F.layer_norm(x, (D,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
        qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd.get(p + "attn.qkv.bias"))
        q, k, v = qkv.reshape(B, N, 3, heads, D // heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q * (D // heads) ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        o = (attn @ v).transpose(1, 2).reshape(B, N, D)
        x = x + F.linear(o, sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        h = F.layer_norm(x, (D,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
        h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])), sd[p + "mlp.fc2.weight"])
        x = x + h + sd[p + "mlp.fc2.bias"]
    x = F.layer_norm(x, (D,), sd["norm.weight"], sd["norm.bias"], 1e-6)
    x = x[:, 0] if pool == "token" else x[:, (1 if cls is not None else 0) :].mean(1)
    return F.linear(x, sd["head.weight"], sd["head.bias"])


def random_timm_state(classifier: str = "token", qkv_bias: bool = True) -> dict[str, torch.Tensor]:
    model = randomize_(
        vitkit.create_model("S/16", image_size=32, patch_size=8, depth=2, num_classes=5, classifier=classifier,
                            qkv_bias=qkv_bias)
    )  # fmt: skip
    return {k: v.clone() for k, v in model.state_dict().items()}  # vitkit's names are timm's here


@pytest.mark.parametrize(("classifier", "qkv_bias"), [("token", True), ("gap", True), ("token", False)])
def test_timm_file_matches_timm_semantics(tmp_path: Path, classifier: str, qkv_bias: bool) -> None:
    sd = random_timm_state(classifier, qkv_bias)
    save_file(sd, str(tmp_path / "vit.safetensors"))
    assert detect_format(tmp_path / "vit.safetensors") == "timm"
    loaded = load_checkpoint(tmp_path / "vit.safetensors")
    model = loaded.model
    assert model.cfg.num_heads == 6 and "inferred" in loaded.meta.provenance["num_heads"]
    assert loaded.meta.preprocess.resize == "crop" and loaded.meta.preprocess.crop_pct == 0.9
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        err = rel_err(model(x), timm_forward(sd, x, 6, pool="token" if classifier == "token" else "avg"))
    assert err < 1e-5, err


def test_no_embed_class_position_embedding(tmp_path: Path) -> None:
    """DeiT-3 / big_vision ports: pos_embed covers the patches only; the class token gets none."""
    sd = random_timm_state()
    sd["pos_embed"] = sd["pos_embed"][:, 1:].clone()
    torch.save(sd, tmp_path / "deit3.pth")
    # 16 entries and a class token: a 4x4 grid without class slot, or a slot plus 15 (3x5): not guessed
    with pytest.raises(CheckpointError, match=r"either a 4x4 grid with no class slot .* non-square grid of 15"):
        vitkit.load_pretrained(tmp_path / "deit3.pth")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "deit3_small", "model_args": {"img_size": 32}}))
    model = vitkit.load_pretrained(tmp_path / "deit3.pth")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(model(x), timm_forward(sd, x, 6, no_embed_class=True)) < 1e-5
    out = save_checkpoint(model, tmp_path / "again.safetensors", "timm")
    assert load_file(str(out))["pos_embed"].shape == (1, 17, 384)  # written back with the (zero) class slot


def test_round_trips_are_bit_exact(tmp_path: Path) -> None:
    model = randomize_(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=2, num_classes=3)).eval()
    x = torch.randn(2, 3, 32, 32)
    for name in ("m.safetensors", "m.pth", "folder"):
        out = save_checkpoint(model, tmp_path / name, "timm", class_names=["a", "b", "c"])
        assert detect_format(out) == "timm"
        loaded = load_checkpoint(out)
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(x), model(x), rtol=0, atol=0)
    doc = json.loads((tmp_path / "folder" / "config.json").read_text())
    assert doc["model_args"]["num_heads"] == 3 and doc["label_names"] == ["a", "b", "c"]
    assert load_checkpoint(tmp_path / "folder").meta.class_names == ["a", "b", "c"]


def test_hub_folder_config_is_used(tmp_path: Path) -> None:
    sd = random_timm_state()
    (tmp_path / "hub").mkdir()
    save_file(sd, str(tmp_path / "hub" / "model.safetensors"))
    cfg = {
        "architecture": "vit_small_patch8_32",
        "model_args": {"num_heads": 12, "img_size": 32},  # 12 heads of 32: not what the width suggests
        "pretrained_cfg": {
            "input_size": [3, 32, 32], "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "crop_pct": 1.0,
            "crop_mode": "squash", "interpolation": "bilinear",
        },
        "label_names": [f"n{i}" for i in range(5)],
    }  # fmt: skip
    (tmp_path / "hub" / "config.json").write_text(json.dumps(cfg))
    loaded = load_checkpoint(tmp_path / "hub")
    assert loaded.model.cfg.num_heads == 12 and loaded.meta.class_names[4] == "n4"
    assert loaded.meta.preprocess.resize == "squash" and loaded.meta.preprocess.interpolation == "bilinear"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(loaded.model(x), timm_forward(sd, x, 12)) < 1e-5
    explicit = tf.load(tmp_path / "hub" / "model.safetensors", num_heads=2)  # an explicit override wins
    assert explicit.cfg.num_heads == 2


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_refusals(tmp_path: Path) -> None:
    sd = random_timm_state("gap")
    sd["fc_norm.weight"], sd["fc_norm.bias"] = sd.pop("norm.weight"), sd.pop("norm.bias")
    save_file(sd, str(tmp_path / "mae.safetensors"))
    with pytest.raises(CheckpointError, match="fc_norm"):
        vitkit.load_pretrained(tmp_path / "mae.safetensors")
    sd = random_timm_state()
    sd["blocks.0.attn.q_norm.weight"] = torch.ones(64)  # layer scale now loads (test_timm_families.py); qk-norm not
    save_file(sd, str(tmp_path / "qk.safetensors"))
    with pytest.raises(CheckpointError, match="qk-norm"):
        vitkit.load_pretrained(tmp_path / "qk.safetensors")
    sd = random_timm_state()
    del sd["blocks.1.mlp.fc2.weight"]
    save_file(sd, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: blocks\.1\.mlp\.fc2\.weight"):
        vitkit.load_pretrained(tmp_path / "partial.safetensors")
    (tmp_path / "evil.pth").write_bytes(b"\x80\x04cos\nsystem\nq\x00.")  # a pickle that would call os.system
    with pytest.raises(CheckpointError, match="weights-only"):
        vitkit.load_pretrained(tmp_path / "evil.pth", format="timm")
    rep = vitkit.create_model("Ti/16", image_size=32, representation_size=8, num_classes=2)
    with pytest.raises(CheckpointError, match="pre-logits"):
        save_checkpoint(rep, tmp_path / "r.safetensors", "timm")
