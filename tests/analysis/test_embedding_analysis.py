"""Patch-embedding PCA and position-embedding similarity against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA

from vitkit.analysis.embeddings import (
    NotApplicable,
    patch_embedding_pca,
    position_embeddings,
    position_similarity,
    similarity_summary,
)
from vitkit.models import create_model
from vitkit.models.posembed import sincos_2d


def test_patch_pca_matches_sklearn() -> None:
    model = create_model("Ti/16", patch_size=4, image_size=16, hidden_size=48, depth=1, num_heads=2, mlp_dim=8)
    with torch.no_grad():  # anisotropic filters so the components are well separated
        w = model.patch_embed.proj.weight  # type: ignore[union-attr]
        w.copy_(torch.randn_like(w) * torch.linspace(3, 0.1, w[0].numel()).reshape(w.shape[1:]))
    pca = patch_embedding_pca(model, num_components=10)
    filters = w.detach().double().reshape(48, -1).numpy()
    ref = PCA(n_components=10, svd_solver="full").fit(filters)
    assert pca.components.shape == (10, 3, 4, 4)
    np.testing.assert_allclose(pca.explained_variance_ratio, ref.explained_variance_ratio_, rtol=1e-9)
    got = pca.components.reshape(10, -1)
    for g, r in zip(got, ref.components_, strict=True):  # equal up to sign
        np.testing.assert_allclose(np.abs(g @ r), 1.0, rtol=1e-9)
        assert g[np.abs(g).argmax()] > 0  # the sign convention: largest entry positive
    # the components are orthonormal and span the filters' principal subspace
    np.testing.assert_allclose(got @ got.T, np.eye(10), atol=1e-10)


def test_patch_pca_count_is_capped_by_the_filter_space() -> None:
    model = create_model("Ti/16", patch_size=2, image_size=8, in_channels=1, hidden_size=32, depth=1, num_heads=2)
    pca = patch_embedding_pca(model, num_components=28)
    assert pca.components.shape == (4, 1, 2, 2)  # 1 x 2 x 2 = 4 dimensions at most
    assert pca.explained_variance_ratio.sum() == pytest.approx(1.0)


def test_hybrid_stems_have_no_pixel_filters() -> None:
    model = create_model("Ti/16", image_size=32, depth=1)
    model.patch_embed = torch.nn.Identity()
    with pytest.raises(NotApplicable):
        patch_embedding_pca(model)


def sincos_model(grid: tuple[int, int], dim: int = 64, classifier: str = "token") -> torch.nn.Module:
    return create_model(
        "Ti/16",
        patch_size=2,
        image_size=(2 * grid[0], 2 * grid[1]),
        hidden_size=dim,
        depth=1,
        num_heads=2,
        pos_embed="sincos2d",
        classifier=classifier,
    )


@pytest.mark.parametrize("grid", [(4, 6), (5, 5)])
def test_sincos_similarity_has_row_and_column_structure(grid: tuple[int, int]) -> None:
    """For 2-D sin-cos codes with the same frequencies on both axes, cos-sim(dr, dc) = s(dr, 0) + s(0, dc) - 1:
    it depends only on the offset and splits into a row part and a column part."""
    model = sincos_model(grid)
    pe, g = position_embeddings(model)  # type: ignore[arg-type]
    assert g == grid and pe.shape == (grid[0] * grid[1], 64)
    sim = position_similarity(pe, grid)
    gh, gw = grid
    for r1, c1, r2, c2 in np.ndindex(gh, gw, gh, gw):
        assert sim[r1, c1, r2, c2] == pytest.approx(sim[r1, c1, r2, c1] + sim[r1, c1, r1, c2] - 1, abs=1e-6)
        assert sim[r1, c1, r2, c2] == pytest.approx(sim[0, 0, abs(r2 - r1), abs(c2 - c1)], abs=1e-6)
    assert np.allclose(sim[np.arange(gh)[:, None], np.arange(gw), np.arange(gh)[:, None], np.arange(gw)], 1.0)
    # the "cross" through each patch is its most similar set; similarity falls off with distance
    s = similarity_summary(sim)
    assert s["neighbours"] > s["same_row_or_column"] > s["other"]
    for r, c in np.ndindex(gh, gw):  # the most similar other patch is a direct neighbour
        others = sim[r, c].copy()
        others[r, c] = -np.inf
        br, bc = np.unravel_index(others.argmax(), others.shape)
        assert abs(br - r) + abs(bc - c) == 1


def test_learned_position_embedding_drops_the_class_token_slot() -> None:
    model = create_model("Ti/16", patch_size=2, image_size=(4, 6), hidden_size=8, depth=1, num_heads=2)
    assert model.pos_embed is not None
    with torch.no_grad():
        model.pos_embed.copy_(torch.arange(7 * 8, dtype=torch.float32).reshape(1, 7, 8))
    pe, grid = position_embeddings(model)
    assert grid == (2, 3)
    np.testing.assert_array_equal(pe, model.pos_embed[0, 1:].detach().double().numpy())
    # a GAP model has no class-token slot and keeps all rows; a sin-cos model returns its fixed table
    gap = sincos_model((3, 2), dim=16, classifier="gap")
    pe, _ = position_embeddings(gap)  # type: ignore[arg-type]
    np.testing.assert_allclose(pe, sincos_2d((3, 2), 16)[0].double().numpy())


def test_similarity_of_orthogonal_codes_is_identity() -> None:
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))
    sim = position_similarity(q * 3.0, (2, 3))
    np.testing.assert_allclose(sim.reshape(6, 6), np.eye(6), atol=1e-12)
