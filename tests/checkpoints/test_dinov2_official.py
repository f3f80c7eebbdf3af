"""The official DINOv2 state dicts (facebookresearch/dinov2 hub layout) against real timm (imported with
torchvision stubbed, see timm_real.py): a random timm DINOv2 model is written in the official layout by
inverting timm's ``_convert_dinov2`` (registers: the class token's position slot taken out of the token again),
timm's own ``checkpoint_filter_fn`` is checked to map that file back onto the timm model, and vitkit's forward on
the file is compared with timm's forward on what timm's filter made of it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from timm_real import import_timm

from helpers import randomize_, rel_err, run_cli
from vitkit.checkpoints import detect_format, load_checkpoint

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
# width 384 (dinov2_vits14's, so 6 heads), 2 blocks, a 4x4 grid of 14 px patches
TINY = {"patch_size": 14, "img_size": 56, "embed_dim": 384, "depth": 2, "num_heads": 6, "init_values": 1e-5}
TINY["num_classes"] = 0


def timm_model(registers: int, swiglu: bool = False, **kw: Any) -> torch.nn.Module:
    assert vt is not None
    args: dict[str, Any] = {**TINY, **kw}
    if registers:
        args.update(reg_tokens=registers, no_embed_class=True)
    if swiglu:  # timm's vit_giant_patch14_dinov2: SwiGLUPacked, silu
        args.update(mlp_layer=sys.modules["timm"].layers.SwiGLUPacked, act_layer="silu", mlp_ratio=2.0)
    torch.manual_seed(0)
    return randomize_(vt.VisionTransformer(**args), std=0.02).eval()


def to_official(model: torch.nn.Module, swiglu: bool) -> dict[str, torch.Tensor]:
    """timm -> official DINOv2 names: the inverse of timm's _convert_dinov2 (SwiGLU's fc1/fc2 are w12/w3)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {"mask_token": torch.randn(1, sd["cls_token"].shape[-1])}
    if "reg_token" in sd:
        slot = torch.randn_like(sd["cls_token"]) * 0.02  # the official class slot, which timm folds into the token
        out["register_tokens"] = sd.pop("reg_token")
        out["cls_token"] = sd.pop("cls_token") - slot
        out["pos_embed"] = torch.cat([slot, sd.pop("pos_embed")], dim=1)
    for k, v in sd.items():
        out[k.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3.") if swiglu else k] = v
    return out


def official_file(tmp_path: Path, registers: int, swiglu: bool = False, **kw: Any) -> tuple[Path, torch.nn.Module]:
    """The official-layout .pth, and a fresh timm model loaded from it through timm's checkpoint_filter_fn."""
    assert vt is not None
    src = timm_model(registers, swiglu, **kw)
    official = to_official(src, swiglu)
    path = tmp_path / f"dinov2_reg{registers}{'_swiglu' if swiglu else ''}.pth"
    torch.save(official, path)
    ref = timm_model(registers, swiglu, **kw)
    for p in ref.parameters():
        p.data.zero_()
    filtered = vt.checkpoint_filter_fn({k: v.clone() for k, v in official.items()}, ref)
    ref.load_state_dict(filtered, strict=True)  # timm's own converter accepts the file: every key, every shape
    for k, v in src.state_dict().items():
        torch.testing.assert_close(ref.state_dict()[k], v, rtol=0, atol=1e-7)  # the inverse is right
    return path, ref.eval()


def features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


@pytest.mark.parametrize(("registers", "swiglu"), [(0, False), (4, False), (4, True)])
def test_official_layout_matches_timm(tmp_path: Path, registers: int, swiglu: bool) -> None:
    path, ref = official_file(tmp_path, registers, swiglu)
    assert detect_format(path) == "dinov2"
    model = load_checkpoint(path).model.eval()
    assert model.cfg.num_registers == registers and model.cfg.mlp == ("swiglu" if swiglu else "plain")
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        err = rel_err(model(x), features(ref, x))
    print(f"dinov2 reg{registers} swiglu={swiglu}: {err:.2e}")
    assert err <= 1e-5


def test_block_chunked_form_reads_the_same(tmp_path: Path) -> None:
    """Training checkpoints with block_chunks=2 (``blocks.{chunk}.{i}.``): the same state as the plain file."""
    path, _ = official_file(tmp_path, 4)
    sd = torch.load(path, weights_only=True)
    chunked = {}
    for k, v in sd.items():
        if k.startswith("blocks."):
            i = int(k.split(".")[1])
            k = f"blocks.{i // (TINY['depth'] // 2)}.{i}.{k.split('.', 2)[2]}"
        chunked[k] = v
    torch.save(chunked, tmp_path / "chunked.pth")
    plain = load_checkpoint(path).model.state_dict()
    for k, v in load_checkpoint(tmp_path / "chunked.pth").model.state_dict().items():
        assert torch.equal(v, plain[k]), k


def test_real_shape_vits14_reg4_at_518(tmp_path: Path) -> None:
    """dinov2_vits14_reg at its hub shape (518 px, 1 + 4 + 1369 tokens, 12 blocks), random weights."""
    kw = {"img_size": 518, "depth": 12}
    path, ref = official_file(tmp_path, 4, **kw)
    model = load_checkpoint(path).model.eval()
    assert model.cfg.image_size == (518, 518) and model.cfg.num_heads == 6
    x = torch.randn(1, 3, 518, 518)
    with torch.no_grad():
        err = rel_err(model(x), features(ref, x))
    print(f"dinov2_vits14_reg at 518: {err:.2e}")
    assert err <= 1e-5


def test_truncated_register_tensor_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = official_file(tmp_path, 4)
    sd = torch.load(path, weights_only=True)
    sd["register_tokens"] = sd["register_tokens"][..., :-1]  # (1, 4, 383)
    torch.save(sd, tmp_path / "bad.pth")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "bad.pth"), str(out), "--to", "vitkit")
    assert code == 2 and "register_tokens" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_missing_key_and_unknown_width_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = official_file(tmp_path, 0)
    sd = torch.load(path, weights_only=True)
    del sd["blocks.1.ls2.gamma"]
    torch.save(sd, tmp_path / "missing.pth")
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "missing.pth"), str(tmp_path / "o1"), "--to", "vitkit")
    assert code == 2 and "blocks.1.ls2.gamma" in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "w").mkdir()
    wide, _ = official_file(tmp_path / "w", 0, embed_dim=64, num_heads=2)  # no released DINOv2 is 64 wide
    code, _, err = run_cli(capsys, "convert", str(wide), str(tmp_path / "o2"), "--to", "vitkit")
    assert code == 2 and "num_heads" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
