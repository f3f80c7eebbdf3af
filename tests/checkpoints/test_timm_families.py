"""timm's newer ViT families through vitkit's timm loader and writer, against the real ``timm`` package (imported
with torchvision stubbed, see timm_real.py; skipped when timm is not installed): DINOv2 with and without
registers (layer scale, ``no_embed_class``), DeiT distilled, SigLIP (MAP head), CLIP (pre-norm, bias-free
patches, QuickGELU, the projection as timm's head) and SwiGLU MLPs (packed and split). Tiny random timm models
are written as a hub folder (state dict + config.json), loaded with ``load_checkpoint`` and compared in fp32;
vitkit's own timm export is loaded back into the timm model that its config.json describes, strictly."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from timm_real import import_timm

import vitkit
from helpers import randomize_, rel_err
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
TINY = {"patch_size": 8, "img_size": 32, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
TINY["num_classes"] = 5
EPS = {"layer_norm_eps": 1e-5}  # vitkit's config.json field: timm's CLIP towers set eps in code
DINO = {"patch_size": 14, "img_size": 56, "init_values": 1e-5}
# name: (timm class, JSON model_args, model_args that are code (not JSON), extra config.json fields)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]] = {
    "dinov2_reg4": ("vit", {**DINO, "reg_tokens": 4, "no_embed_class": True}, {}, {}),
    "dinov2": ("vit", DINO, {}, {}),
    "deit_distilled": ("deit", {}, {}, {}),
    "siglip": ("vit", {"class_token": False, "global_pool": "map", "act_layer": "gelu_tanh"}, {}, {}),
    "siglip_exact": ("vit", {"class_token": False, "global_pool": "map", "act_layer": "gelu"}, {}, {}),
    "clip_quickgelu": ("vit", {"pre_norm": True, "act_layer": "quick_gelu"}, {"eps": "1e-5"}, EPS),
    "clip": ("vit", {"pre_norm": True, "act_layer": "gelu", "num_classes": 16}, {"eps": "1e-5"}, EPS),
    "swiglu_packed": ("vit", {"init_values": 1e-5, "act_layer": "silu", "mlp_ratio": 3.0}, {"mlp": "SwiGLUPacked"}, {}),
    "swiglu_split": ("vit", {"act_layer": "silu", "mlp_ratio": 1.5}, {"mlp": "SwiGLU"}, {}),
}


def _timm() -> Any:
    assert vt is not None
    return sys.modules["timm"]


def code_args(code: dict[str, str]) -> dict[str, Any]:
    """The model_args a config.json cannot hold (classes), as timm's entry points pass them."""
    layers = _timm().layers
    out: dict[str, Any] = {}
    if "eps" in code:
        out["norm_layer"] = partial(layers.LayerNorm, eps=float(code["eps"]))
    if "mlp" in code:
        out["mlp_layer"] = getattr(layers, code["mlp"])
    return out


def timm_family(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    kind, args, code, _ = FAMILIES[name]
    full = {**TINY, **args}
    cls = sys.modules["timm.models.deit"].VisionTransformerDistilled if kind == "deit" else vt.VisionTransformer
    torch.manual_seed(0)
    return randomize_(cls(**full, **code_args(code))).eval(), full


def write(folder: Path, model: torch.nn.Module, doc: dict[str, Any]) -> Path:
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(doc))
    return folder


def features_and_logits(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        tokens = model.forward_features(x)
        return model.forward_head(tokens, pre_logits=True), model.forward_head(tokens)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_loads_exactly(tmp_path: Path, name: str) -> None:
    ref, args = timm_family(name)
    doc = {"architecture": "vit_custom", "model_args": args, **FAMILIES[name][3]}
    loaded = load_checkpoint(write(tmp_path / "hub", ref, doc)).model.eval()
    x = torch.randn(2, 3, args["img_size"], args["img_size"])
    (f, y), (f_ref, y_ref) = features_and_logits(loaded, x), features_and_logits(ref, x)
    errors = rel_err(f, f_ref), rel_err(y, y_ref), rel_err(loaded(x), ref(x))
    print(f"{name}: features {errors[0]:.2e}, logits {errors[1]:.2e}")
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("name", list(FAMILIES))
def test_written_back_loads_into_timm_strictly(tmp_path: Path, name: str) -> None:
    """vitkit -> timm folder -> ``timm.create_model(architecture, **model_args)``: every tensor equal to timm's
    original, the same outputs bit for bit; and read back into vitkit, the same function bit for bit."""
    ref, args = timm_family(name)
    doc = {"architecture": "vit_custom", "model_args": args, **FAMILIES[name][3]}
    loaded = load_checkpoint(write(tmp_path / "hub", ref, doc)).model.eval()
    out = save_checkpoint(loaded, tmp_path / "out", "timm")
    written = json.loads((out / "config.json").read_text())
    extra: dict[str, Any] = {}
    if "layer_norm_eps" in written:
        extra = {"norm_layer": partial(_timm().layers.LayerNorm, eps=written["layer_norm_eps"])}
    if FAMILIES[name][2].get("mlp") == "SwiGLU":
        extra["mlp_layer"] = _timm().layers.SwiGLUPacked  # vitkit writes the packed layout, its own
    rebuilt = _timm().create_model(written["architecture"], pretrained=False, **written["model_args"], **extra).eval()
    rebuilt.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    if FAMILIES[name][2].get("mlp") != "SwiGLU":
        for key, value in ref.state_dict().items():
            assert torch.equal(rebuilt.state_dict()[key], value), key
    x = torch.randn(2, 3, args["img_size"], args["img_size"])
    with torch.no_grad():
        if FAMILIES[name][2].get("mlp") == "SwiGLU":
            # timm's split SwiGLU (two GEMMs of the hidden width) against the packed one (one of twice it): the
            # same products, summed in another order by oneDNN on some CPUs (Zen 5: ~1e-7)
            assert rel_err(rebuilt(x), ref(x)) <= 1e-6
        else:
            assert torch.equal(rebuilt(x), ref(x))
        assert torch.equal(load_checkpoint(out).model.eval()(x), loaded(x))


def test_real_shapes(tmp_path: Path) -> None:
    """vit_small_patch14_reg4_dinov2 (random weights, 224 px) from a hub-style config.json with no model_args
    (registers, layer scale and no_embed_class read from the weights), and vit_base_patch16_siglip_224 (about 15 s
    on two cores)."""
    cases = [
        ("vit_small_patch14_reg4_dinov2", {"img_size": 224}, {}),
        ("vit_base_patch16_siglip_224", {}, {"model_args": {"act_layer": "gelu"}}),
    ]
    for arch, kwargs, extra in cases:
        torch.manual_seed(0)
        ref = randomize_(_timm().create_model(arch, pretrained=False, **kwargs), std=0.02).eval()
        doc = {"architecture": arch, "pretrained_cfg": {"input_size": [3, 224, 224]}, **extra}
        loaded = load_checkpoint(write(tmp_path / arch, ref, doc)).model.eval()
        x = torch.randn(1, 3, 224, 224)
        (f, y), (f_ref, y_ref) = features_and_logits(loaded, x), features_and_logits(ref, x)
        print(f"{arch}: features {rel_err(f, f_ref):.2e}, logits {rel_err(y, y_ref):.2e}")
        assert rel_err(f, f_ref) <= 1e-5 and rel_err(y, y_ref) <= 1e-5


def refusal(tmp_path: Path, name: str, edit: Any, doc_edit: Any = None) -> str:
    ref, args = timm_family(name)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    edit(sd)
    doc: dict[str, Any] = {"architecture": "vit_custom", "model_args": dict(args), **FAMILIES[name][3]}
    if doc_edit:
        doc_edit(doc)
    folder = tmp_path / "bad"
    folder.mkdir(parents=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    def truncate(sd: dict[str, torch.Tensor]) -> None:
        sd["reg_token"] = sd["reg_token"][:, :3].clone()

    def halve(sd: dict[str, torch.Tensor]) -> None:
        sd["reg_token"] = sd["reg_token"][..., :16].clone()

    def keep(sd: dict[str, torch.Tensor]) -> None:
        pass

    def args(**kw: Any) -> Any:
        return lambda doc: doc["model_args"].update(kw)

    assert "model_args.reg_tokens=4, but the weights hold 3" in refusal(tmp_path / "a", "dinov2_reg4", truncate)
    assert "reg_token has shape (1, 4, 16)" in refusal(tmp_path / "b", "dinov2_reg4", halve)
    assert "act_layer 'relu' is not supported" in refusal(tmp_path / "c", "siglip", keep, args(act_layer="relu"))
    assert "act_layer ['gelu'] is not supported" in refusal(tmp_path / "k", "siglip", keep, args(act_layer=["gelu"]))
    assert "model_args.pre_norm=False" in refusal(tmp_path / "d", "clip", keep, args(pre_norm=False))
    wrong_size = refusal(tmp_path / "e", "dinov2", keep, args(img_size=70))
    assert "pos_embed has 17 entries, but the image size (70, 70)" in wrong_size
    assert "model_args.class_token=True" in refusal(tmp_path / "f", "siglip", keep, args(class_token=True))
    no_act = refusal(tmp_path / "g", "siglip", keep, lambda doc: doc["model_args"].pop("act_layer"))
    assert "no model_args.act_layer" in no_act
    assert "needs act_layer 'silu'" in refusal(tmp_path / "h", "swiglu_packed", keep, args(act_layer="gelu"))
    assert "layer_norm_eps" in refusal(tmp_path / "i", "clip", keep, lambda doc: doc.pop("layer_norm_eps"))
    assert "model_args.init_values=0.1, but the weights have no" in refusal(
        tmp_path / "j", "siglip", keep, args(init_values=0.1)
    )


def test_still_refused_features_are_named(tmp_path: Path) -> None:
    assert vt is not None
    qk = randomize_(vt.VisionTransformer(**TINY, qk_norm=True)).eval()
    folder = write(tmp_path / "qk", qk, {"architecture": "vit_custom", "model_args": TINY})
    with pytest.raises(CheckpointError, match="qk-norm"):
        load_checkpoint(folder)
    reg_slots = randomize_(vt.VisionTransformer(**TINY, reg_tokens=2)).eval()  # no_embed_class=False: slots
    args = {**TINY, "reg_tokens": 2, "no_embed_class": False}
    with pytest.raises(CheckpointError, match=r"position slots \(no_embed_class=False\)"):
        load_checkpoint(write(tmp_path / "slots", reg_slots, {"architecture": "vit_custom", "model_args": args}))


@pytest.mark.parametrize(
    "options",
    [
        {"num_registers": 4, "layer_scale": 0.1},  # transformers' DINOv2-with-registers layout: a class slot
        {"norm_pre": True, "patch_bias": False, "gelu": "quick", "projection_size": 12, "num_classes": 0},
        {"distilled": True, "num_classes": 3},
        {"classifier": "map", "class_token": True, "gelu": "tanh"},
        {"classifier": "gap", "class_token": True, "mlp": "swiglu"},
    ],
)
def test_vitkit_models_export_to_timm(tmp_path: Path, options: dict[str, Any]) -> None:
    """vitkit-built models of the families -> timm folder -> the timm model its config.json names, loaded
    strictly and computing the same outputs: the class slot of a model with registers is folded into the class
    token (timm's DINOv2 has no_embed_class), CLIP's projection becomes timm's bias-free head, a MAP head beside a
    class token pools every token (pool_include_prefix)."""
    kw = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
    model = randomize_(vitkit.create_model("Ti/16", **{"num_classes": 5, **kw, **options}), std=0.1).eval()
    out = save_checkpoint(model, tmp_path / "out", "timm")
    written = json.loads((out / "config.json").read_text())
    extra = {"norm_layer": partial(_timm().layers.LayerNorm, eps=written.get("layer_norm_eps", 1e-6))}
    rebuilt = _timm().create_model(written["architecture"], pretrained=False, **written["model_args"], **extra).eval()
    rebuilt.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(rebuilt(x), model(x)) <= 1e-6
        assert torch.equal(load_checkpoint(out).model.eval()(x), model(x))
