"""The fast path is built from the same block description as the model (``vitkit.models.config``): for every
architectural option, alone and in combination, ``optimize_for_inference`` computes the plain model's function
(features: fp32 within 1e-5, bf16 within 3e-2 or 1.5x the plain model's own bf16 error where that is larger,
int8 within 0.1, relative; logits: the head on the fast path's own final tokens, within the head's own rounding in
that precision), at the native image size and at another one.

The default suite runs a pairwise covering set of the option space (every value of every option meets every
value of every other option in at least one tested config, where the config allows the pair); the slow suite
runs a 3-wise covering set (every three option values an allowed config combines), in fp32 and bf16.
"""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import fields
from typing import Any

import pytest
import torch

from vitkit import optimize_for_inference
from vitkit.inference.int8 import has_onednn_int8
from vitkit.models.config import ViTConfig
from vitkit.models.kernel_paths import set_fused_attention
from vitkit.models.vit import VisionTransformer

# every option of the descendants (and the paper's that change the block), with the values to try
OPTIONS: dict[str, list[Any]] = {
    "classifier": ["token", "gap", "map"],
    "class_token": [None, True, False],
    "distilled": [False, True],
    "num_registers": [0, 2],
    "pos_embed": ["learned", "sincos2d", "none"],
    "pos_embed_prefix": [True, False],
    "pos_resample": ["bilinear", "bicubic", "bicubic_plain", "bicubic_offset"],
    "rope": [None, "dinov3", "eva"],
    "rope_ref_grid": [None, (3, 2)],
    "layer_scale": [None, 0.5],
    "mlp": ["plain", "swiglu"],
    "mlp_norm": [False, True],
    "attn_norm": [False, True],
    "fc_norm": [False, True],
    "gelu": ["exact", "tanh", "quick"],
    "norm_pre": [False, True],
    "patch_bias": [True, False],
    "key_bias": [True, False],
    "qkv_bias": [True, False],
    "projection_size": [None, 8],
    "representation_size": [None, 12],
}
# the fields that are sizes, rates or bookkeeping, not a choice of architecture (covered elsewhere)
NOT_OPTIONS = {
    "image_size", "patch_size", "in_channels", "num_classes", "hidden_size", "depth", "num_heads", "mlp_dim",
    "dropout", "attention_dropout", "drop_path", "layer_norm_eps", "head_bias_init", "resnet_layers",
    "resnet_width", "rope_theta", "name", "extra",
}  # fmt: skip
SIZE = {"image_size": 16, "patch_size": 8, "hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 24}
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _config(choice: dict[str, Any]) -> ViTConfig | None:
    try:
        return ViTConfig(num_classes=3, **SIZE, **choice)
    except ValueError:  # a combination the config refuses (e.g. RoPE with a learned position embedding)
        return None


def _pool(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` random configs that the config allows (deterministic)."""
    rng = random.Random(seed)
    pool: list[dict[str, Any]] = []
    while len(pool) < n:
        c = {k: rng.choice(v) for k, v in OPTIONS.items()}
        if _config(c) is not None:
            pool.append(c)
    return pool


def _tuples(choice: dict[str, Any], t: int = 2) -> set[tuple[tuple[str, Any], ...]]:
    """The t-tuples of (option, value) that ``choice`` exercises together."""
    return set(itertools.combinations(sorted(choice.items(), key=lambda kv: kv[0]), t))


def _covering_set(t: int = 2, pool_size: int = 600, seed: int = 0) -> list[dict[str, Any]]:
    """A t-wise covering set of the configs in a random pool (greedy, deterministic): each step keeps the
    config that exercises the most t-tuples not exercised yet, until every t-tuple of the pool is."""
    pool = _pool(pool_size, seed)
    exercised = [_tuples(c, t) for c in pool]
    todo = set().union(*exercised)
    chosen: list[dict[str, Any]] = []
    while todo:
        i = max(range(len(pool)), key=lambda j: len(exercised[j] & todo))
        chosen.append(pool[i])
        todo -= exercised[i]
    return chosen


COVERING = _covering_set()


def _model(choice: dict[str, Any]) -> VisionTransformer:
    cfg = _config(choice)
    assert cfg is not None
    torch.manual_seed(len(COVERING))
    model = VisionTransformer(cfg).eval()
    with torch.no_grad():  # away from the initialisation's zeros and ones (head, class token, LayerNorm)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _check(choice: dict[str, Any], dtype: torch.dtype, bound: float, int8: bool = False) -> None:
    model = _model(choice)
    fast = optimize_for_inference(model, dtype, batch_size=2, int8=int8)
    low = copy.deepcopy(model).to(dtype)  # the plain model in the fast path's dtype: the head's own rounding
    for size in ((16, 16), (24, 32)):  # the native grid, and one whose positions are resampled / recomputed
        x = torch.randn(2, 3, *size)
        with torch.inference_mode():
            ref = model.forward_head(model.forward_features(x), pre_logits=True)
            logits = fast(x)
            tokens = fast.forward_features(x)  # type: ignore[operator]
            feats = fast.forward_head(tokens, pre_logits=True)  # type: ignore[operator]
            # the head, given the fast path's own final tokens: in fp32, and in the fast path's dtype
            head_ref = model.forward_head(tokens.float())
            head_low = low.forward_head(tokens.to(dtype))
            low_feats = low.forward_head(low.forward_features(x.to(dtype)), pre_logits=True)
        assert ref.abs().max() > 0.05
        # a low precision is held to the bound, or to 1.5x the plain model's own error in it where that is larger
        # (a width-16 toy in bf16 rounds by ~3% itself; a dropped or misplaced option costs far more)
        feat_bound = bound if dtype == torch.float32 else max(bound, 1.5 * _rel(low_feats, ref))
        assert _rel(feats, ref) < feat_bound, (choice, size, "features", _rel(feats, ref), feat_bound)
        # logits: the body's error is the features' (above); a small, nearly cancelling head amplifies the low
        # precision's rounding past any fixed bound, so the head is held to its own rounding in that precision
        head_bound = max(1e-5 if dtype == torch.float32 else 1e-2, 3 * _rel(head_low, head_ref))
        assert _rel(logits, head_ref) < head_bound, (choice, size, "logits", _rel(logits, head_ref), head_bound)


def test_the_option_table_is_the_config() -> None:
    """A new ViTConfig field is either an option tried here or named as not one: adding an option without
    testing the fast path against the model fails here."""
    names = {f.name for f in fields(ViTConfig)}
    assert set(OPTIONS) | NOT_OPTIONS == names
    assert not set(OPTIONS) & NOT_OPTIONS


def test_the_covering_set_covers_every_pair_and_every_value() -> None:
    """Every pair of option values that occurs in an independent sample of 20,000 allowed configs occurs in a
    tested config (so does every value of every option)."""
    covered = set().union(*(_tuples(c) for c in COVERING))
    wanted = set().union(*(_tuples(c) for c in _pool(20_000, seed=1)))
    assert wanted <= covered, sorted(wanted - covered)[:5]
    assert {(k, v) for k, vs in OPTIONS.items() for v in vs} <= {kv for c in COVERING for kv in c.items()}
    assert len(COVERING) < 60


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("choice", COVERING, ids=[f"c{i}" for i in range(len(COVERING))])
def test_fast_path_equals_the_model(choice: dict[str, Any], dtype: torch.dtype) -> None:
    _check(choice, dtype, BOUNDS[dtype])


@pytest.mark.skipif(not has_onednn_int8(), reason="int8 inference needs oneDNN's int8 kernels")
@pytest.mark.parametrize("choice", COVERING[::3], ids=[f"c{i}" for i in range(0, len(COVERING), 3)])
def test_int8_fast_path_close_to_the_model(choice: dict[str, Any]) -> None:
    _check(choice, torch.bfloat16, 0.1, int8=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_triple_of_options(dtype: torch.dtype) -> None:
    """A 3-wise covering set: every three option values that an allowed config combines, in one tested config."""
    for choice in _covering_set(t=3, pool_size=3000, seed=2):
        _check(choice, dtype, BOUNDS[dtype])


@pytest.mark.parametrize("choice", COVERING, ids=[f"c{i}" for i in range(len(COVERING))])
def test_the_training_kernel_path_computes_the_model(choice: dict[str, Any]) -> None:
    """The block's other route (``kernel_paths``: the explicit attention with its own backward pass) reads the
    same description: forward and gradients equal the block's own modules'."""
    model = _model(choice).train()
    x = torch.randn(2, 3, 24, 32)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    set_fused_attention(model, False)
    out = model(x)
    out.square().sum().backward()
    assert _rel(out, ref) < 1e-5
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(ref_grads)
    assert all(_rel(g, r) < 1e-4 for g, r in zip(grads, ref_grads, strict=True) if r.norm() > 0)
