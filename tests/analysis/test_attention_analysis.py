"""Mean attention distance and attention rollout against closed-form answers.

Expected values are computed by brute force over patch coordinates (``divmod`` on the row-major token
index), independently of the implementation's distance matrix.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vitkit.analysis.analyze import AnalyzeOptions, attention_analysis
from vitkit.analysis.attention_maps import (
    attention_maps,
    attention_rollout,
    mean_attention_distance,
    rollout_maps,
    upsample_maps,
)
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer

GRID = (3, 5)  # non-square on purpose: a row/column mix-up changes every answer
P = 4


def coords(i: int, gw: int) -> tuple[int, int]:
    return divmod(i, gw)


def brute_uniform_mean(grid: tuple[int, int], stride: int) -> float:
    """E|centre_q - centre_k| in pixels for q, k uniform over the grid, by enumeration."""
    cells = list(itertools.product(range(grid[0]), range(grid[1])))
    total = sum(math.dist(a, b) for a in cells for b in cells)
    return stride * total / len(cells) ** 2


def uniform_attention(B: int, h: int, T: int) -> torch.Tensor:
    return torch.full((B, h, T, T), 1.0 / T, dtype=torch.float64)


@pytest.mark.parametrize("prefix", [0, 1])
def test_uniform_attention_gives_the_analytic_mean(prefix: int) -> None:
    N = GRID[0] * GRID[1]
    attn = uniform_attention(2, 3, prefix + N)
    expected = brute_uniform_mean(GRID, P)
    got = mean_attention_distance(attn, GRID, P, prefix)
    assert torch.allclose(got, torch.full((2, 3), expected, dtype=torch.float64), rtol=1e-12)
    # without renormalisation the class token's share counts as distance 0
    raw = mean_attention_distance(attn, GRID, P, prefix, renormalize=False)
    assert torch.allclose(raw, torch.full((2, 3), expected * N / (N + prefix), dtype=torch.float64), rtol=1e-12)


def test_uniform_on_square_grid_matches_the_continuous_limit() -> None:
    # for a fine n x n grid the mean distance tends to 0.5214 x side (mean distance in the unit square)
    n = 24
    attn = uniform_attention(1, 1, n * n)
    got = float(mean_attention_distance(attn, (n, n), 1, 0))
    unit_square = (2 + math.sqrt(2) + 5 * math.log(1 + math.sqrt(2))) / 15
    assert got == pytest.approx(brute_uniform_mean((n, n), 1), rel=1e-12)
    assert got / n == pytest.approx(unit_square, rel=0.01)


def test_neighbour_attention_is_one_patch_away() -> None:
    """Uniform attention over the 4-connected neighbours: every key is exactly one stride away."""
    gh, gw = GRID
    N = gh * gw
    attn = torch.zeros(1, 1, N + 1, N + 1, dtype=torch.float64)
    attn[..., 0, 0] = 1.0
    for q in range(N):
        r, c = coords(q, gw)
        keys = [
            rr * gw + cc for rr, cc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)) if 0 <= rr < gh and 0 <= cc < gw
        ]
        for k in keys:
            attn[0, 0, 1 + q, 1 + k] = 1.0 / len(keys)
    assert float(mean_attention_distance(attn, GRID, P, 1)) == pytest.approx(P, rel=1e-12)


def test_attention_to_next_token_wraps_rows() -> None:
    """Query i attends to token i + 1 (row-major): one stride, except at the end of a row."""
    gh, gw = GRID
    N = gh * gw
    attn = torch.zeros(1, 1, N, N, dtype=torch.float64)
    expected = []
    for q in range(N):
        k = (q + 1) % N
        attn[0, 0, q, k] = 1.0
        expected.append(P * math.dist(coords(q, gw), coords(k, gw)))
    got = float(mean_attention_distance(attn, GRID, P, 0))
    assert got == pytest.approx(float(np.mean(expected)), rel=1e-12)


def test_mismatched_attention_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not match"):
        mean_attention_distance(uniform_attention(1, 1, 10), GRID, P, 1)


# ---- through a real model ----------------------------------------------------------------------------


def tiny_model(classifier: str = "token", pos_embed: str = "learned") -> VisionTransformer:
    return create_model(
        "Ti/16",
        patch_size=P,
        image_size=(GRID[0] * P, GRID[1] * P),
        hidden_size=64,
        depth=3,
        num_heads=2,
        mlp_dim=64,
        num_classes=3,
        classifier=classifier,
        pos_embed=pos_embed,
    ).eval()


@torch.no_grad()
def zero_queries_and_keys(model: VisionTransformer) -> None:
    """q = k = 0 in every layer: attention logits are all 0, so attention is exactly uniform."""
    D = model.cfg.hidden_size
    for blk in model.blocks:
        blk.attn.qkv.weight[: 2 * D] = 0  # type: ignore[index, union-attr]
        blk.attn.qkv.bias[: 2 * D] = 0  # type: ignore[index, union-attr]


@torch.no_grad()
def force_self_attention(model: VisionTransformer, scale: float = 3.0) -> None:
    """Tokens = near-orthogonal position codes (no image content), q = k = scale * LN(token):
    every token attends (almost) only to itself, the most local attention there is."""
    D, T = model.cfg.hidden_size, model.cfg.num_prefix_tokens + GRID[0] * GRID[1]
    q, _ = torch.linalg.qr(torch.randn(D, D))
    assert model.pos_embed is not None
    model.pos_embed.copy_(q[:T].unsqueeze(0) * math.sqrt(D))
    model.patch_embed.proj.weight.zero_()  # type: ignore[union-attr]
    for blk in model.blocks:
        w = blk.attn.qkv.weight  # type: ignore[union-attr]
        w.zero_()
        w[:D] = scale * torch.eye(D)
        w[D : 2 * D] = scale * torch.eye(D)
        blk.attn.qkv.bias.zero_()  # type: ignore[union-attr]
        blk.attn.proj.weight.zero_()  # type: ignore[union-attr]
        blk.mlp.fc2.weight.zero_()  # type: ignore[union-attr]
        blk.mlp.fc2.bias.zero_()  # type: ignore[union-attr]


@pytest.mark.parametrize(("classifier", "pos_embed"), [("token", "learned"), ("gap", "sincos2d")])
def test_model_with_uniform_attention_gives_the_analytic_mean(classifier: str, pos_embed: str) -> None:
    model = tiny_model(classifier, pos_embed)
    zero_queries_and_keys(model)
    x = torch.randn(5, 3, GRID[0] * P, GRID[1] * P)
    res = attention_analysis(model, [x[:3], x[3:]], AnalyzeOptions(max_overlays=4), progress=False)
    assert res.num_images == 5 and res.mean_distance.shape == (3, 2)
    np.testing.assert_allclose(res.mean_distance, brute_uniform_mean(GRID, P), rtol=1e-6)
    assert res.rollout.shape == (4, GRID[0] * P, GRID[1] * P) and res.layer_maps.shape == (4, 2, *res.rollout.shape[1:])


def test_model_with_local_attention_has_small_distance() -> None:
    model = tiny_model()
    force_self_attention(model)
    x = torch.randn(4, 3, GRID[0] * P, GRID[1] * P)
    with torch.no_grad():
        attn = model.forward_intermediates(x).attentions[0]
    assert float(torch.diagonal(attn, dim1=-2, dim2=-1).min()) > 0.99  # it really is self-attention
    res = attention_analysis(model, [x], progress=False)
    assert res.mean_distance.max() < 0.02 * P
    assert res.mean_distance.max() < 0.01 * brute_uniform_mean(GRID, P)


# ---- rollout ---------------------------------------------------------------------------------------------


def test_rollout_of_identity_attention_is_identity() -> None:
    T = 1 + GRID[0] * GRID[1]
    eye = torch.eye(T).expand(2, 3, T, T)
    R = attention_rollout([eye] * 4)
    assert torch.equal(R, torch.eye(T, dtype=torch.float64).expand(2, T, T))


def random_attention(B: int, h: int, T: int) -> torch.Tensor:
    return torch.randn(B, h, T, T).softmax(dim=-1)


def test_rollout_matches_the_explicit_formula() -> None:
    T = 1 + GRID[0] * GRID[1]
    a1, a2, a3 = (random_attention(2, 3, T) for _ in range(3))

    def step(a: np.ndarray) -> np.ndarray:  # (h, T, T) -> heads averaged, + identity, rows renormalised
        m = a.mean(axis=0) + np.eye(T)
        return m / m.sum(axis=1, keepdims=True)

    for b in range(2):
        want = step(a3[b].double().numpy()) @ step(a2[b].double().numpy()) @ step(a1[b].double().numpy())
        got = attention_rollout([a1, a2, a3])[b].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)


def test_rollout_map_points_at_the_attended_patch() -> None:
    """Every layer: the class token attends only to patch j, everything else to itself. The rollout's
    class-token row is then 2^-L on itself and 1 - 2^-L on patch j: the map is one hot at j's cell."""
    gh, gw = GRID
    T, L = 1 + gh * gw, 3
    j = 7  # row 1, column 2
    a = torch.eye(T).repeat(1, 2, 1, 1)
    a[:, :, 0] = 0
    a[:, :, 0, 1 + j] = 1
    m = rollout_maps([a] * L, GRID, num_prefix=1)[0]
    want = torch.zeros(gh, gw, dtype=torch.float64)
    want[coords(j, gw)] = 1 - 2.0**-L
    assert torch.allclose(m, want)


def test_gap_maps_average_over_all_tokens() -> None:
    N = GRID[0] * GRID[1]
    a = random_attention(1, 2, N)
    np.testing.assert_allclose(
        attention_maps(a, GRID, 0)[0].numpy(), a[0].mean(dim=1).reshape(2, *GRID).numpy(), rtol=1e-6
    )
    np.testing.assert_allclose(
        rollout_maps([a], GRID, 0)[0].numpy(), attention_rollout([a])[0].mean(dim=0).reshape(GRID).numpy()
    )


def test_class_token_maps_take_row_zero_over_patches() -> None:
    T = 1 + GRID[0] * GRID[1]
    a = random_attention(2, 3, T)
    got = attention_maps(a, GRID, 1)
    assert got.shape == (2, 3, *GRID)
    assert torch.equal(got[1, 2], a[1, 2, 0, 1:].reshape(GRID))


def test_upsampled_maps_span_zero_to_one() -> None:
    maps = torch.rand(2, 3, *GRID)
    up = upsample_maps(maps, (GRID[0] * P, GRID[1] * P))
    assert up.shape == (2, 3, GRID[0] * P, GRID[1] * P)
    assert torch.allclose(up.amin(dim=(-2, -1)), torch.zeros(2, 3)) and torch.allclose(
        up.amax(dim=(-2, -1)), torch.ones(2, 3)
    )
