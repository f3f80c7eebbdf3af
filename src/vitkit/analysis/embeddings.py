"""What a ViT learned in its embeddings: patch-embedding filters and position embeddings (paper fig. 7).

- :func:`patch_embedding_pca`: principal components of the D linear filters of the patch embedding (each
  filter is a C x P x P image), computed by an SVD of the mean-centred (D, C*P*P) filter matrix, as
  scikit-learn's PCA does. Components are unit vectors with a fixed sign (largest-magnitude entry
  positive), shown as RGB tiles.
- :func:`position_similarity`: cosine similarity between the position embedding of every patch and those
  of all other patches, as a (gh, gw, gh, gw) array: ``sim[r, c]`` is the small grid of patch (r, c).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vitkit.models.vit import PatchEmbed, VisionTransformer


class NotApplicable(Exception):
    """This analysis does not apply to this model (e.g. pixel-space filters of a hybrid model)."""


@dataclass
class PatchPCA:
    components: np.ndarray  # (n, C, P, P) unit-norm principal directions
    explained_variance_ratio: np.ndarray  # (n,)
    singular_values: np.ndarray  # (n,)


def patch_filters(model: VisionTransformer) -> np.ndarray:
    """The patch embedding's filters (D, C, P, P) in pixel space; NotApplicable for hybrid stems."""
    stem = model.patch_embed
    if not isinstance(stem, PatchEmbed):
        raise NotApplicable("the patch embedding acts on a CNN feature map (hybrid model), not on pixels")
    return stem.proj.weight.detach().cpu().double().numpy()


def patch_embedding_pca(model: VisionTransformer, num_components: int = 28) -> PatchPCA:
    """Top principal components of the patch-embedding filters (paper fig. 7 left shows 28)."""
    w = patch_filters(model)  # (D, C, P, P)
    x = w.reshape(w.shape[0], -1)  # (D, C*P*P)
    x = x - x.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(x, full_matrices=False)  # vt: (M, C*P*P)
    n = min(num_components, len(s))
    comps = vt[:n]
    flip = np.sign(comps[np.arange(n), np.abs(comps).argmax(axis=1)])  # largest entry positive
    comps = comps * flip[:, None]
    var = s**2
    ratio = var / var.sum() if var.sum() > 0 else np.zeros_like(var)
    return PatchPCA(comps.reshape(n, *w.shape[1:]), ratio[:n], s[:n])


def position_embeddings(model: VisionTransformer) -> tuple[np.ndarray, tuple[int, int]]:
    """The patch part of the position embedding at the native grid, (N, D), and that grid.

    Learned embeddings drop the class- and distillation-token slots (registers have none); ``sincos2d`` models
    return their fixed table; a model without position embedding (RoPE) is NotApplicable.
    """
    if model.cfg.pos_embed == "none":
        raise NotApplicable("the model has no position embedding (pos_embed none: RoPE rotates q and k instead)")
    prefix = model.cfg.num_pos_prefix
    pe: torch.Tensor = model.pos_embed[0, prefix:] if model.pos_embed is not None else model.pos_table[0]
    return pe.detach().cpu().double().numpy(), model.cfg.grid_size


def position_similarity(pe: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Cosine similarity of every patch's position embedding with every other: (gh, gw, gh, gw)."""
    gh, gw = grid
    if pe.shape[0] != gh * gw:
        raise ValueError(f"{pe.shape[0]} position embeddings for a {gh}x{gw} grid")
    unit = pe / np.maximum(np.linalg.norm(pe, axis=1, keepdims=True), 1e-12)
    return (unit @ unit.T).reshape(gh, gw, gh, gw)


def similarity_summary(sim: np.ndarray) -> dict[str, float | None]:
    """Scalar summaries of a (gh, gw, gh, gw) similarity array, as evidence of learned 2-D structure.

    ``same_row_or_column``: mean similarity to other patches in the same row or column; ``other``: to the
    rest; ``neighbours``: to the 4-connected neighbours; ``far``: to patches more than 2 rows or columns away
    (None when the grid has no such pairs).
    """
    gh, gw = sim.shape[:2]
    r = np.arange(gh)[:, None, None, None]
    c = np.arange(gw)[None, :, None, None]
    r2 = np.arange(gh)[None, None, :, None]
    c2 = np.arange(gw)[None, None, None, :]
    same = (r == r2) & (c == c2)
    cross = ((r == r2) | (c == c2)) & ~same
    other = ~((r == r2) | (c == c2))
    neigh = (np.abs(r - r2) + np.abs(c - c2)) == 1
    far = np.maximum(np.abs(r - r2), np.abs(c - c2)) > 2

    def mean(mask: np.ndarray) -> float | None:
        m = np.broadcast_to(mask, sim.shape)
        return float(sim[m].mean()) if m.any() else None

    return {"same_row_or_column": mean(cross), "other": mean(other), "neighbours": mean(neigh), "far": mean(far)}
