"""OpenAI CLIP / OpenCLIP state dicts (``visual.*``) against real timm (imported with torchvision stubbed, see
timm_real.py): a random timm CLIP tower (pre-norm, bias-free patches, eps 1e-5, QuickGELU or GELU, the
projection as a bias-free head) is written in OpenAI's layout by inverting timm's ``_convert_openai_clip``, with
a text tower beside it; timm's own ``checkpoint_filter_fn`` must map the file back onto the timm model, and
vitkit's forward on the file is compared with timm's. The activation, which no weight shows, comes from
open_clip_config.json or the file's name, and is refused when nothing says."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from timm_real import import_timm

from helpers import randomize_, rel_err, run_cli
from vitkit.checkpoints import detect_format, load_checkpoint
from vitkit.errors import CheckpointError

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
TINY = {"patch_size": 8, "img_size": 32, "embed_dim": 128, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
SWAPS = [  # timm name -> OpenAI name: the inverse of timm's _convert_openai_clip swaps
    ("patch_embed.proj", "conv1"), ("pos_embed", "positional_embedding"), ("blocks.", "transformer.resblocks."),
    ("norm_pre", "ln_pre"), (".norm1", ".ln_1"), (".norm2", ".ln_2"), ("attn.qkv.", "attn.in_proj_"),
    ("attn.proj", "attn.out_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"),
]  # fmt: skip


def timm_clip(quick: bool, arch: str | None = None, **kw: Any) -> torch.nn.Module:
    assert vt is not None
    timm = sys.modules["timm"]
    torch.manual_seed(0)
    if arch is not None:
        model = timm.create_model(arch, pretrained=False, **kw)
    else:
        act = "quick_gelu" if quick else "gelu"
        eps = partial(timm.layers.LayerNorm, eps=1e-5)
        model = vt.VisionTransformer(**TINY, pre_norm=True, act_layer=act, norm_layer=eps, num_classes=16, **kw)
    randomize_(model, std=0.02)
    model.head.bias.data.zero_()  # timm's CLIP heads are the bias-free projection
    return model.eval()


def to_openai(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k == "head.bias":
            continue
        if k == "head.weight":
            out["visual.proj"] = v.T.contiguous()
            continue
        if k == "cls_token":
            out["visual.class_embedding"] = v.reshape(-1).clone()
            continue
        if k == "pos_embed":
            v = v[0]
        if k in ("norm.weight", "norm.bias"):
            k = k.replace("norm", "ln_post")
        for timm_name, openai in SWAPS:
            k = k.replace(timm_name, openai)
        out["visual." + k] = v.clone()
    # a text tower and the temperature: not the image tower's, ignored
    out.update({"token_embedding.weight": torch.randn(10, 8), "transformer.resblocks.0.ln_1.weight": torch.ones(8)})
    out["logit_scale"] = torch.tensor(4.6)
    return out


def openai_file(path: Path, src: torch.nn.Module) -> Path:
    """The OpenAI-layout file; timm's own filter must map it back onto ``src`` exactly."""
    assert vt is not None
    sd = to_openai(src)
    torch.save(sd, path)
    back = vt.checkpoint_filter_fn({k: v.clone() for k, v in sd.items()}, src)
    assert sorted(back) == sorted(src.state_dict())
    for k, v in src.state_dict().items():
        assert torch.equal(back[k], v), k
    return path


def features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(("quick", "how"), [(True, "name"), (True, "config"), (False, "config")])
def test_openai_layout_matches_timm(tmp_path: Path, quick: bool, how: str) -> None:
    ref = timm_clip(quick)
    name = "ViT-T-8-quickgelu.pth" if how == "name" else "open_clip_pytorch_model.bin"
    path = openai_file(tmp_path / name, ref)
    if how == "config":
        doc = {"model_cfg": {"quick_gelu": quick, "vision_cfg": {"width": 128, "layers": 2, "patch_size": 8}}}
        (tmp_path / "open_clip_config.json").write_text(json.dumps(doc))
    assert detect_format(path) == "openclip"
    loaded = load_checkpoint(path)
    model = loaded.model.eval()
    assert model.cfg.gelu == ("quick" if quick else "exact") and model.cfg.projection_size == 16
    assert model.cfg.norm_pre and not model.cfg.patch_bias and model.cfg.layer_norm_eps == 1e-5
    x = torch.randn(2, 3, 32, 32)
    err = rel_err(features(model, x), features(ref, x))
    print(f"openclip quick={quick} ({how}): {err:.2e}; {loaded.meta.provenance['gelu']}")
    assert err <= 1e-5


def test_real_shape_clip_b32_quickgelu(tmp_path: Path) -> None:
    """vit_base_patch32_clip_quickgelu_224 (CLIP-B/32 with QuickGELU, random weights, its 512-wide projection)."""
    ref = timm_clip(True, "vit_base_patch32_clip_quickgelu_224", num_classes=512)
    path = openai_file(tmp_path / "ViT-B-32-openai.pth", ref)
    model = load_checkpoint(path).model.eval()
    assert model.cfg.num_heads == 12 and model.cfg.gelu == "quick" and model.cfg.image_size == (224, 224)
    x = torch.randn(1, 3, 224, 224)
    err = rel_err(features(model, x), features(ref, x))
    print(f"CLIP B/32 quickgelu: {err:.2e}")
    assert err <= 1e-5


def test_activation_unsaid_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = openai_file(tmp_path / "clip.pth", timm_clip(True))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", str(path), str(out), "--to", "vitkit")
    assert code == 2 and "QuickGELU" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    from vitkit.checkpoints import openclip

    assert openclip.load(path, gelu="quick").cfg.gelu == "quick"


def test_missing_key_and_unsupported_field_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = to_openai(timm_clip(True))
    del sd["visual.ln_post.weight"]
    torch.save(sd, tmp_path / "ViT-openai.pth")
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "ViT-openai.pth"), str(tmp_path / "o"), "--to", "vitkit")
    assert code == 2 and "visual.ln_post.weight" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    (tmp_path / "b").mkdir()
    path = openai_file(tmp_path / "b" / "open_clip_model.safetensors.pth", timm_clip(False))
    doc = {"model_cfg": {"vision_cfg": {"attentional_pool": True}}}
    (tmp_path / "b" / "open_clip_config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"vision_cfg.attentional_pool=True is not supported"):
        load_checkpoint(path)
