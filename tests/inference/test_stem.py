"""The fast path's patch embedding as a pre-packed GEMM (PackedStem) against the model's own embed (convolution,
class token, position embedding) for every embedding variant."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_, rel_err
from vitkit.inference.fast import InferenceViT, PackedLinear
from vitkit.inference.stem import PackedStem
from vitkit.models import create_model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classifier": "gap"},
        {"pos_embed": "sincos2d"},
        {"pos_embed": "sincos2d", "classifier": "gap"},
        {"image_size": (32, 64), "patch_size": 8},
    ],
)
@pytest.mark.parametrize("rows", [None, 3 * 10])
def test_stem_equals_the_models_embed(overrides: dict, rows: int | None) -> None:
    """fp32: the same sums (the convolution and the GEMM) up to summation order; bf16: one rounding apart."""
    kw: dict = {"num_classes": 5, "image_size": 48, "depth": 1, **overrides}
    model = randomize_(create_model("Ti/16", **kw)).eval()
    x = torch.randn(3, 3, *model.cfg.image_size)
    bias = model.patch_embed.proj.bias.detach().clone()
    with torch.inference_mode():
        ref = model.embed(x).reshape(-1, model.cfg.hidden_size)  # (B*T, D)
        stem = PackedStem(model, torch.float32, rows, PackedLinear)
        assert torch.equal(model.patch_embed.proj.bias, bias)  # zeroed for a moment only
        assert stem.supports(x)
        assert rel_err(stem(x), ref) < 1e-6
        stem16 = PackedStem(model, torch.bfloat16, rows, PackedLinear)
        out = stem16(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-2


def test_other_image_sizes_take_the_models_embed() -> None:
    """At another resolution the position embedding is resampled: the fast path does not use the stem there
    and still matches the model."""
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=48, depth=1)).eval()
    fast = InferenceViT(model, torch.float32, rows=None)
    assert fast.stem is not None
    x = torch.randn(2, 3, 64, 64)
    assert not fast.stem.supports(x)
    with torch.inference_mode():
        assert rel_err(fast.forward_features(x), model.forward_features(x)) < 1e-5
        fast.use_stem = False
        y = torch.randn(2, 3, 48, 48)
        plain = fast.forward_features(y)
        fast.use_stem = True
        assert rel_err(fast.forward_features(y), plain) < 1e-6


@pytest.mark.parametrize("int8", [False, True])
def test_hybrid_models_keep_their_resnet_stem(int8: bool) -> None:
    """A hybrid's stem is a ResNet before the projection: the fast path leaves it to the model (building a
    PackedStem from its projection crashed optimize_for_inference) and computes the model's function."""
    model = randomize_(create_model("R26+S/32", num_classes=5, image_size=64, depth=1)).eval()
    assert not PackedStem.handles(model)
    with pytest.raises(ValueError, match="replaces a PatchEmbed"):
        PackedStem(model, torch.float32, None, PackedLinear)
    fast = InferenceViT(model, torch.bfloat16, rows=None, int8=int8)
    assert fast.stem is None
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        assert rel_err(fast(x), model(x)) < (0.1 if int8 else 3e-2)
