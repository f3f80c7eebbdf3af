"""Device placement without a GPU: every tensor a forward pass creates must live on the input's device.

The meta device stands in for CUDA: an op that mixes a meta tensor with one created on the CPU (an index or
weight table built without ``device=``) raises "Tensor on device cpu is not on the expected device meta", as
it would raise for CUDA. So these tests catch, on a CPU-only machine, the class of bug where a path works on
the CPU and crashes on a GPU: the model at its own and at other resolutions (position-embedding resampling,
sin-cos tables, hybrids), the analysis functions on its attention, and the inference fast path.
"""

from __future__ import annotations

import pytest
import torch

from helpers import meta_model
from vitkit.analysis.attention_maps import (
    attention_maps,
    distance_matrix,
    mean_attention_distance,
    rollout_maps,
    upsample_maps,
)
from vitkit.inference import optimize_for_inference
from vitkit.models.posembed import resample_grid, sincos_2d
from vitkit.models.vit import VisionTransformer

META = torch.device("meta")
SMALL = {"hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64, "num_classes": 3}
MODELS = {
    "learned": {"patch_size": 8, "image_size": 32, **SMALL},
    "gap": {"patch_size": 8, "image_size": 32, "classifier": "gap", **SMALL},
    "sincos": {"patch_size": 8, "image_size": 32, "pos_embed": "sincos2d", **SMALL},
    "hybrid": {"resnet_layers": (1,), "patch_size": 1, "image_size": 32, **SMALL},
}
SIZES = [(32, 32), (48, 64)]  # native, and a non-native non-square resolution (resampled position embedding)


def small_meta(kind: str) -> VisionTransformer:
    """One of the small MODELS on the meta device, in eval mode."""
    return meta_model("R50+B/16" if kind == "hybrid" else "Ti/16", **MODELS[kind]).eval()


def test_a_cpu_tensor_in_a_meta_forward_is_an_error() -> None:
    """The premise: meta does not silently accept a CPU operand (as CUDA does not)."""
    x = torch.empty(1, 4, 3, 3, device=META)
    with pytest.raises(RuntimeError, match="device"):
        x * torch.ones(3, dtype=torch.float64)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("size", SIZES)
def test_forward_and_intermediates_stay_on_the_device(kind: str, size: tuple[int, int]) -> None:
    model = small_meta(kind)
    x = torch.empty(2, 3, *size, device=META)
    with torch.no_grad():
        logits = model(x)
        out = model.forward_intermediates(x)
    assert logits.device == META and logits.shape == (2, 3)
    grid = model.grid_of(x)
    tokens = model.cfg.num_prefix_tokens + grid[0] * grid[1]
    assert all(a.device == META and a.shape == (2, 2, tokens, tokens) for a in out.attentions)


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_position_embedding_resampling_and_resize_stay_on_the_device(method: str) -> None:
    pe = torch.empty(1, 1 + 4 * 4, 32, device=META)
    assert resample_grid(pe, (4, 4), (6, 8), 1, method).shape == (1, 1 + 48, 32)
    assert resample_grid(pe, (4, 4), (1, 8), 1, method).device == META  # the one-pixel axis path
    assert resample_grid(pe[:, :5], (1, 4), (5, 4), 1, method).device == META
    assert sincos_2d((3, 5), 32, device=META).device == META
    model = small_meta("learned")
    model.resize_image((48, 64), method)
    assert model.pos_embed is not None and model.pos_embed.device == META
    assert model.pos_embed.shape == (1, 1 + 6 * 8, 32)
    sincos = small_meta("sincos")
    sincos.resize_image(64)
    assert sincos.pos_table.device == META and sincos.pos_table.shape == (1, 64, 32)


@pytest.mark.parametrize("kind", ["learned", "gap"])
def test_attention_analysis_stays_on_the_device(kind: str) -> None:
    model = small_meta(kind)
    x = torch.empty(2, 3, 48, 64, device=META)
    grid, prefix, stride = model.grid_of(x), model.cfg.num_prefix_tokens, model.cfg.stride
    with torch.no_grad():
        attns = model.forward_intermediates(x).attentions
    dist = distance_matrix(grid, stride, META)
    assert mean_attention_distance(attns[0], grid, stride, prefix, True, dist).shape == (2, 2)
    assert mean_attention_distance(attns[1], grid, stride, prefix, False).device == META
    assert upsample_maps(rollout_maps(attns, grid, prefix), (48, 64)).shape == (2, 48, 64)
    maps = upsample_maps(attention_maps(attns[-1], grid, prefix), (48, 64))
    assert maps.device == META and maps.shape == (2, 2, 48, 64)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_fast_path_stays_on_the_device(kind: str, dtype: torch.dtype) -> None:
    fast = optimize_for_inference(small_meta(kind), dtype)
    for size in SIZES:
        logits = fast(torch.empty(2, 3, *size, device=META))
        assert logits.device == META and logits.shape == (2, 3) and logits.dtype == dtype
