"""Hugging Face CLIP and SigLIP image towers, both ways, against transformers' own models on random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import randomize_, rel_err
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # relative error of the pooled outputs (fp32)
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "image_size": 32, "patch_size": 8}  # fmt: skip


def clip(projection: bool = True, **kw: Any) -> Any:
    cfg = transformers.CLIPVisionConfig(**{**TINY, "projection_dim": 24, **kw})
    cls = transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel
    torch.manual_seed(0)
    return randomize_(cls(cfg)).eval()


def siglip(**kw: Any) -> Any:
    torch.manual_seed(0)
    return randomize_(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**{**TINY, **kw}))).eval()


def _outputs(ref: Any, x: torch.Tensor, interpolate: bool) -> dict[str, torch.Tensor]:
    """transformers' pooled outputs: pooler_output (CLIP: the normed class token; SigLIP: the MAP head's) and,
    with a projection, image_embeds."""
    with torch.no_grad():
        if isinstance(ref, transformers.CLIPVisionModelWithProjection):
            pooled = ref.vision_model(pixel_values=x, interpolate_pos_encoding=interpolate).pooler_output
            return {
                "pooler_output": pooled,
                "image_embeds": ref(pixel_values=x, interpolate_pos_encoding=interpolate).image_embeds,
            }
        return {"pooler_output": ref(pixel_values=x, interpolate_pos_encoding=interpolate).pooler_output}


def _ours(model: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        tokens = model.forward_features(x)
        return {"pooler_output": model.pool(tokens), "image_embeds": model.forward_head(tokens)}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: clip(), id="clip-projection"),
        pytest.param(lambda: clip(projection=False, hidden_act="gelu", layer_norm_eps=1e-6), id="clip-gelu"),
        pytest.param(lambda: siglip(), id="siglip"),
        pytest.param(lambda: siglip(hidden_act="gelu", num_channels=1), id="siglip-gelu-1ch"),
    ],
)
def test_loads_and_matches_transformers(tmp_path: Path, make: Any) -> None:
    ref = make()
    ref.save_pretrained(tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    model = load_checkpoint(tmp_path / "hf").model.eval()
    c = ref.config
    assert (model.cfg.layer_norm_eps, model.cfg.hidden_size) == (c.layer_norm_eps, c.hidden_size)
    for size, interpolate in (((32, 32), False), ((48, 40), True)):  # native, and another size (interpolated)
        x = torch.randn(2, c.num_channels, *size)
        want, got = _outputs(ref, x, interpolate), _ours(model, x)
        for name, ref_out in want.items():
            err = rel_err(got[name], ref_out)
            print(f"{c.model_type} {name} {size}: relative error {err:.2e}")  # shown with -s
            assert err < TOL, (name, size, err)
    if isinstance(ref, transformers.CLIPVisionModelWithProjection):
        with torch.no_grad():
            assert rel_err(model(x), ref(pixel_values=x, interpolate_pos_encoding=True).image_embeds) < TOL


def test_full_text_and_vision_folders_load_the_vision_tower(tmp_path: Path) -> None:
    text = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    vis = transformers.CLIPVisionConfig(**TINY).to_dict()
    torch.manual_seed(0)
    full = randomize_(
        transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vis, projection_dim=24))
    )
    full.eval().save_pretrained(tmp_path / "clip")
    loaded = load_checkpoint(tmp_path / "clip")
    assert "vision tower only" in loaded.meta.provenance["layout"] and "text tower" in loaded.meta.provenance["ignored"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(loaded.model.eval()(x), full.get_image_features(pixel_values=x).pooler_output) < TOL
    torch.manual_seed(1)
    sig = randomize_(transformers.SiglipModel(transformers.SiglipConfig(
        text_config=text, vision_config=transformers.SiglipVisionConfig(**TINY).to_dict())))  # fmt: skip
    sig.eval().save_pretrained(tmp_path / "siglip")
    loaded = load_checkpoint(tmp_path / "siglip")
    assert "vision tower only" in loaded.meta.provenance["layout"]
    with torch.no_grad():
        assert rel_err(loaded.model.eval()(x), sig.vision_model(pixel_values=x).pooler_output) < TOL


@pytest.mark.parametrize("make", [lambda: clip(), lambda: clip(projection=False), lambda: siglip()])
def test_round_trip_is_bit_exact_and_transformers_loads_it(tmp_path: Path, make: Any) -> None:
    ref = make()
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model
    save_checkpoint(model, tmp_path / "out", "hf")
    original, written = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)
    again, info = type(ref).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = torch.randn(2, 3, 32, 32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_outputs(again.eval(), x, False).values(), _outputs(ref, x, False).values(), strict=True)
    )
    back = load_checkpoint(tmp_path / "out").model
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_real_shape_clip_b32(tmp_path: Path) -> None:
    """CLIP-B/32's shapes (random weights): 12 blocks of width 768, 50 tokens, projection to 512."""
    torch.manual_seed(0)
    cfg = transformers.CLIPVisionConfig(projection_dim=512)  # transformers' defaults are CLIP-B/32's
    ref = randomize_(transformers.CLIPVisionModelWithProjection(cfg), std=0.02).eval()
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model.eval()
    x = torch.randn(2, 3, 224, 224)
    want, got = _outputs(ref, x, False), _ours(model, x)
    for name, ref_out in want.items():
        err = rel_err(got[name], ref_out)
        print(f"CLIP-B/32 {name}: relative error {err:.2e}")
        assert err < TOL, (name, err)


@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("clip", {}),  # CLIP's defaults: shortest edge 224, centre crop 224, bicubic
        ("clip", {"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}, "resample": 2}),
        ("siglip", {}),  # straight to 224 x 224, bicubic, mean/std 0.5
        ("siglip", {"size": {"height": 224, "width": 224}, "image_mean": [0.4, 0.5, 0.6], "resample": 2}),
        # the hub's older form of openai/clip-vit-base-patch32 (a feature extractor, int sizes)
        ("clip", {"feature_extractor_type": "CLIPFeatureExtractor", "size": 224, "crop_size": 224, "resample": 3}),
    ],
)
def test_preprocessing_matches_the_image_processor(tmp_path: Path, kind: str, kw: dict[str, Any]) -> None:
    from PIL import Image
    from sklearn.datasets import load_sample_images

    ref = clip(image_size=224, patch_size=32) if kind == "clip" else siglip(image_size=224, patch_size=32)
    ref.save_pretrained(tmp_path / "hf")
    if "feature_extractor_type" in kw:  # written as the hub holds it; transformers reads it back below
        (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(kw))
    else:
        proc_cls = transformers.CLIPImageProcessorPil if kind == "clip" else transformers.SiglipImageProcessorPil
        proc_cls(**kw).save_pretrained(tmp_path / "hf")
    proc = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")  # transformers' reading of the file
    pre = load_checkpoint(tmp_path / "hf").meta.preprocess
    std = np.asarray(pre.std, dtype=np.float32)[:, None, None]
    for img in load_sample_images().images:  # two 427 x 640 photographs
        want = proc(images=Image.fromarray(img), return_tensors="np")["pixel_values"][0]
        got = pre(Image.fromarray(img)).numpy()
        assert got.shape == want.shape
        levels = float((np.abs(got - want) * std * 255).max())  # in 0..255 pixel levels, per channel
        print(f"{kind} {kw}: {levels:.4f} levels")
        assert levels <= 1.0 + 1e-3, levels


def test_preprocessing_writes_back(tmp_path: Path) -> None:
    ref = clip(image_size=224, patch_size=32)
    ref.save_pretrained(tmp_path / "hf")
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 256}).save_pretrained(tmp_path / "hf")
    loaded = load_checkpoint(tmp_path / "hf")
    save_checkpoint(loaded.model, tmp_path / "out", "hf", meta=loaded.meta)
    proc = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    assert (proc.size["shortest_edge"], proc.crop_size["height"], proc.resample) == (256, 224, 3)
    assert load_checkpoint(tmp_path / "out").meta.preprocess == loaded.meta.preprocess


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"hidden_size": 48}, "shape mismatches"),  # config and weights disagree
        ({"image_size": 40}, "pos_embed: expected"),
        ({"vision_use_head": False}, "vision_use_head"),
        ({"patch_size": "8"}, "patch_size must be an integer"),
    ],
)
def test_bad_folders_are_one_line(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    siglip().save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **change)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(tmp_path / "hf")
    assert "\n" not in str(e.value)


def test_missing_or_extra_weights_are_one_line(tmp_path: Path) -> None:
    clip().save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    weights = load_file(str(path))
    del weights["vision_model.pre_layrnorm.weight"]
    weights["vision_model.extra"] = torch.zeros(1)
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match=r"missing keys: vision_model\.pre_layrnorm\.weight.*unexpected keys: "
                       r"vision_model\.extra") as e:  # fmt: skip
        load_checkpoint(tmp_path / "hf")
    assert "\n" not in str(e.value)


def test_unrepresentable_models_are_refused(tmp_path: Path) -> None:
    ref = siglip()
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model
    model.reset_head(3)
    with pytest.raises(CheckpointError, match="cannot compute this model: it has a classifier head"):
        save_checkpoint(model, tmp_path / "out", "hf")


def test_projection_width_comes_from_the_config_and_must_match_the_weights(tmp_path: Path) -> None:
    clip().save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", projection_dim=20)
    with pytest.raises(CheckpointError, match=r"projection\.weight: expected \(20, 32\), got \(24, 32\)") as e:
        load_checkpoint(tmp_path / "hf")
    assert "\n" not in str(e.value)
    path = tmp_path / "hf" / "model.safetensors"
    weights = load_file(str(path))
    del weights["visual_projection.weight"]
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match=r"missing keys: visual_projection\.weight"):
        load_checkpoint(tmp_path / "hf")  # architectures says CLIPVisionModelWithProjection


def test_older_transformers_position_ids_buffer_is_ignored(tmp_path: Path) -> None:
    ref = clip(projection=False)
    ref.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    weights = {f"vision_model.{k}": v for k, v in load_file(str(path)).items()}  # older layout: prefixed
    weights["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    save_file(weights, str(path))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(load_checkpoint(tmp_path / "hf").model.eval()(x), ref(pixel_values=x).pooler_output) < TOL


@pytest.mark.parametrize(
    ("kw", "hf_class"),
    [
        ({"norm_pre": True, "patch_bias": False, "gelu": "quick", "projection_size": 16},
         "CLIPVisionModelWithProjection"),
        ({"norm_pre": True, "patch_bias": False, "gelu": "exact", "pos_embed": "sincos2d"}, "CLIPVisionModel"),
        ({"classifier": "map", "class_token": False, "gelu": "tanh"}, "SiglipVisionModel"),
    ],
)  # fmt: skip
def test_vitkit_models_write_as_transformers_computes_them(tmp_path: Path, kw: dict[str, Any], hf_class: str) -> None:
    from vitkit.models import create_model

    torch.manual_seed(0)
    model = randomize_(create_model("Ti/16", image_size=32, patch_size=8, hidden_size=32, depth=2, num_heads=2,
                                    mlp_dim=64, num_classes=0, layer_norm_eps=1e-5, **kw)).eval()  # fmt: skip
    save_checkpoint(model, tmp_path / "out", "hf")
    ref, info = getattr(transformers, hf_class).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = torch.randn(2, 3, 32, 32)
    want, got = _outputs(ref.eval(), x, False), _ours(model, x)
    for name, ref_out in want.items():
        assert rel_err(got[name], ref_out) < TOL, name
