"""What the attention of a ViT looks at: mean attention distance, attention rollout, raw attention maps.

All functions take the attention probabilities of ``VisionTransformer.forward_intermediates`` (one
(B, h, T, T) tensor per layer; rows are queries, columns keys; the first ``num_prefix`` tokens are the prefix
tokens, ``[class, distillation, registers...]`` as far as the model has them, then the patch grid in row-major
order) and work batched on any device.

Conventions (also in the README and the ``analyze`` JSON):

- **Mean attention distance** (paper fig. 7 right, fig. 11): for every head, the attention-weighted
  Euclidean distance in pixels between the centres of the query patch and the key patches, averaged over
  query patches and images. Pixel distance = patch-grid distance x the model's patch stride. Only patch
  tokens count: the prefix tokens (class, distillation, registers) have no position, so they are dropped as
  queries and as keys, and each query's weights over the patch keys are renormalised to sum to 1
  (``renormalize=True``), which makes the value a true weighted mean distance whatever mass went to the prefix
  tokens (registers draw much of it). With ``renormalize=False`` the mass on the prefix tokens counts as
  distance 0 (some community plots do this; the value is then smaller).
- **Attention rollout** (Abnar & Zuidema 2020, paper fig. 6/14): per layer, average the heads, add the
  identity for the residual connection, renormalise the rows to sum to 1, and multiply through the layers
  (R = A_L ... A_1). The map of an image is the class token's row of R over the patch tokens; a model without
  a class token (GAP, MAP) has its map as the mean of the patch tokens' rows of R (registers are no query).
- **Raw attention maps**: one layer's attention of the class token (without one: the mean over the patch
  queries) to the patch tokens, per head.

The maps cover the patch grid only: every prefix token is left out as a key. ``class_token`` (None: there is
one iff ``num_prefix > 0``) says whether token 0 is a class token; a model with registers and no class token
(``ViTConfig.class_token``) passes False.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def wide_dtype(device: torch.device | None) -> torch.dtype:
    """float64 for the reductions, except on devices without it (Apple MPS): float32 there."""
    return torch.float32 if device is not None and device.type == "mps" else torch.float64


def patch_centres(grid: tuple[int, int], stride: int, device: torch.device | None = None) -> torch.Tensor:
    """Pixel coordinates (row, col) of each patch centre, (N, 2), row-major like the token sequence."""
    gh, gw = grid
    dt = wide_dtype(device)
    r, c = torch.meshgrid(
        torch.arange(gh, dtype=dt, device=device),
        torch.arange(gw, dtype=dt, device=device),
        indexing="ij",
    )
    return (torch.stack([r.flatten(), c.flatten()], dim=1) + 0.5) * stride  # (N, 2)


def distance_matrix(grid: tuple[int, int], stride: int, device: torch.device | None = None) -> torch.Tensor:
    """(N, N) Euclidean pixel distances between patch centres."""
    centres = patch_centres(grid, stride, device)
    return torch.cdist(centres, centres)  # (N, N)


def mean_attention_distance(
    attn: torch.Tensor,
    grid: tuple[int, int],
    stride: int,
    num_prefix: int,
    renormalize: bool = True,
    distances: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, h): mean attention distance in pixels of every head for every image (module doc).

    ``attn`` is one layer's (B, h, T, T) attention probabilities; ``distances`` an optional precomputed
    :func:`distance_matrix` to reuse across layers.
    """
    N = grid[0] * grid[1]
    if attn.shape[-1] != num_prefix + N or attn.shape[-2] != num_prefix + N:
        raise ValueError(f"attention over {attn.shape[-1]} tokens does not match {num_prefix} + {grid[0]}x{grid[1]}")
    dt = wide_dtype(attn.device)
    a = attn[..., num_prefix:, num_prefix:].to(dt)  # (B, h, N, N) patch queries x patch keys
    if renormalize:
        a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    dist = (distance_matrix(grid, stride, attn.device) if distances is None else distances).to(dt)
    per_query = (a * dist).sum(dim=-1)  # (B, h, N)
    return per_query.mean(dim=-1)  # (B, h)


def attention_rollout(attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    """(B, T, T) rollout R = A_L ... A_1 with A_l = rownorm(mean_heads(attn_l) + I) (module doc)."""
    if not attentions:
        raise ValueError("attention rollout needs the attention of at least one layer")
    rollout: torch.Tensor | None = None
    for attn in attentions:
        a = attn.to(wide_dtype(attn.device)).mean(dim=1)  # (B, T, T) heads averaged
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # later layers multiply from the left
    assert rollout is not None
    return rollout


def rollout_maps(
    attentions: Sequence[torch.Tensor], grid: tuple[int, int], num_prefix: int, class_token: bool | None = None
) -> torch.Tensor:
    """(B, gh, gw): how much each patch flows into the pooled representation, by attention rollout."""
    return attention_maps(attention_rollout(attentions), grid, num_prefix, class_token)


def attention_maps(
    attn: torch.Tensor, grid: tuple[int, int], num_prefix: int, class_token: bool | None = None
) -> torch.Tensor:
    """(B, h, gh, gw): one layer's attention from the class token (without one: mean over the patch queries) to
    the patches (module doc for ``class_token``).

    ``attn`` is (..., T, T) (one layer's attention, or a rollout: :func:`rollout_maps`); returns (..., gh, gw) over
    patch keys: per map the class-token row, or the mean of the patch tokens' rows.
    """
    N = grid[0] * grid[1]
    if attn.shape[-1] != num_prefix + N:
        raise ValueError(f"attention over {attn.shape[-1]} tokens does not match {num_prefix} + {grid[0]}x{grid[1]}")
    if class_token is None:
        class_token = num_prefix > 0
    rows = attn[..., 0, :] if class_token else attn[..., num_prefix:, :].mean(dim=-2)  # (..., T)
    return rows[..., num_prefix:].reshape(*rows.shape[:-1], grid[0], grid[1])


def upsample_maps(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patch-grid maps (..., gh, gw) -> pixel maps (..., H, W), bilinear, each rescaled to [0, 1]."""
    lead = maps.shape[:-2]
    x = maps.reshape(-1, 1, *maps.shape[-2:]).float()
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)  # (M, 1, H, W)
    lo = x.amin(dim=(-2, -1), keepdim=True)
    hi = x.amax(dim=(-2, -1), keepdim=True)
    x = (x - lo) / (hi - lo).clamp_min(1e-12)
    return x.reshape(*lead, *size)
