"""big_vision SigLIP .npz image towers against real timm (imported with torchvision stubbed, see timm_real.py): a
random timm SigLIP model (MAP head, tanh-GELU, no class token) is written as a big_vision npz by vitkit's writer
(through vitkit's timm loader), timm's own ``_load_weights`` reads that npz into a fresh timm model, which must
equal the original tensor for tensor (so the writer's layout is the one timm reads); vitkit's forward on the npz
is compared with that timm model's, and vitkit's write-back with the file it read."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from timm_real import import_timm

from helpers import randomize_, rel_err, run_cli
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint, siglip_npz

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
TINY = {"patch_size": 8, "img_size": 32, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
SIGLIP = {"class_token": False, "global_pool": "map", "act_layer": "gelu_tanh", "num_classes": 32}


def timm_siglip(arch: str | None = None, **kw: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    assert vt is not None
    torch.manual_seed(0)
    if arch is None:
        args = {**TINY, **SIGLIP, **kw}
        return randomize_(vt.VisionTransformer(**args), std=0.05).eval(), args
    model = sys.modules["timm"].create_model(arch, pretrained=False, act_layer="gelu_tanh", **kw)
    return randomize_(model, std=0.02).eval(), {"act_layer": "gelu_tanh", **kw}


def siglip_file(tmp_path: Path, ref: torch.nn.Module, args: dict[str, Any], scan: bool = False) -> Path:
    """timm model -> (vitkit's timm loader) -> vitkit's SigLIP writer -> .npz."""
    folder = tmp_path / "timm"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_custom", "model_args": args}))
    model = load_checkpoint(folder).model
    return siglip_npz.write(model, tmp_path / f"siglip{'_scan' if scan else ''}.npz", scan=scan)


def timm_from_npz(path: Path, like: torch.nn.Module) -> torch.nn.Module:
    assert vt is not None
    model = copy.deepcopy(like)
    for p in model.parameters():
        p.data.zero_()
    with torch.no_grad():
        vt._load_weights(model, str(path), prefix="params/img/")
    return model.eval()


def outputs(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        tokens = model.forward_features(x)
        return model.forward_head(tokens, pre_logits=True), model.forward_head(tokens)


@pytest.mark.parametrize("scan", [False, True])
def test_siglip_npz_matches_timm(tmp_path: Path, scan: bool) -> None:
    ref, args = timm_siglip()
    path = siglip_file(tmp_path, ref, args, scan)
    assert detect_format(path) == "siglip"
    timm_model = timm_from_npz(path, ref)
    for k, v in ref.state_dict().items():  # timm reads back exactly what was written
        assert torch.equal(timm_model.state_dict()[k], v), k
    loaded = load_checkpoint(path)
    model = loaded.model.eval()
    assert model.cfg.classifier == "map" and model.cfg.gelu == "tanh" and not model.cfg.class_token
    x = torch.randn(2, 3, 32, 32)
    (f, y), (f_ref, y_ref) = outputs(model, x), outputs(timm_model, x)
    print(f"siglip tiny scan={scan}: pooled {rel_err(f, f_ref):.2e}, head {rel_err(y, y_ref):.2e}")
    assert rel_err(f, f_ref) <= 1e-5 and rel_err(y, y_ref) <= 1e-5
    back = save_checkpoint(model, tmp_path / "back.npz", "siglip", meta=loaded.meta)
    with np.load(path) as a, np.load(back) as b:
        first = {k: a[k] for k in a.files}
        if scan:  # the writer's default is per-block: compare the unstacked arrays
            first = {siglip_npz.PREFIX + k: v for k, v in siglip_npz.big_vision.unstack_scan(
                {k.removeprefix(siglip_npz.PREFIX): v for k, v in first.items()}, "x").items()}  # fmt: skip
        assert sorted(first) == sorted(b.files)
        assert all(np.array_equal(first[k], b[k]) for k in b.files)


def test_real_shape_siglip_b16_256(tmp_path: Path) -> None:
    """vit_base_patch16_siglip_256 (SigLIP-B/16-256, random weights) with its 768-wide image-embedding head."""
    ref, args = timm_siglip("vit_base_patch16_siglip_256", num_classes=768)
    args = {"img_size": 256, "patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12, **SIGLIP, **args}
    path = siglip_file(tmp_path, ref, args)
    timm_model = timm_from_npz(path, ref)
    model = load_checkpoint(path).model.eval()
    assert model.cfg.image_size == (256, 256) and model.cfg.num_heads == 12
    x = torch.randn(1, 3, 256, 256)
    (f, y), (f_ref, y_ref) = outputs(model, x), outputs(timm_model, x)
    print(f"siglip B/16-256: pooled {rel_err(f, f_ref):.2e}, head {rel_err(y, y_ref):.2e}")
    assert rel_err(f, f_ref) <= 1e-5 and rel_err(y, y_ref) <= 1e-5


def test_missing_probe_key_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, args = timm_siglip()
    path = siglip_file(tmp_path, ref, args)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "params/img/MAPHead_0/LayerNorm_0/scale"}
    np.savez(tmp_path / "bad.npz", **arrays)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "bad.npz"), str(out), "--to", "vitkit")
    assert code == 2 and "MAPHead_0/LayerNorm_0/scale" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_writer_refuses_a_class_token_model(tmp_path: Path) -> None:
    from vitkit.errors import CheckpointError
    from vitkit.models.variants import create_model

    with pytest.raises(CheckpointError, match="MAP head"):
        save_checkpoint(create_model("Ti/16", num_classes=0), tmp_path / "x.npz", "siglip")
    assert not (tmp_path / "x.npz").exists()
