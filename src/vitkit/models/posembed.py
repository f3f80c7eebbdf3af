"""Position-embedding helpers: fixed 2-D sin-cos tables and resampling of learned grids.

Learned embeddings are stored the official way: (1, prefix + gh * gw, D), the optional class-token slot
first, then the patch grid in row-major order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sincos_2d(
    grid: tuple[int, int], dim: int, temperature: float = 10_000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Fixed 2-D sin-cos table of shape (1, gh * gw, dim), as big_vision's ``posemb_sincos_2d``, on ``device``.

    The first half of the channels encodes the column (x), the second half the row (y); within each half,
    sines come before cosines. ``dim`` must be divisible by 4.
    """
    gh, gw = grid
    if dim % 4 != 0:
        raise ValueError(f"sincos2d position embeddings need a width divisible by 4, got {dim}")
    f64 = {"dtype": torch.float64, "device": device}
    y, x = torch.meshgrid(torch.arange(gh, **f64), torch.arange(gw, **f64), indexing="ij")  # type: ignore[arg-type]
    omega = torch.arange(dim // 4, **f64) / (dim // 4 - 1 if dim > 4 else 1)  # type: ignore[arg-type]
    omega = 1.0 / temperature**omega  # (D/4,)
    y = y.flatten()[:, None] * omega[None, :]  # (N, D/4)
    x = x.flatten()[:, None] * omega[None, :]  # (N, D/4)
    pe = torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)  # (N, D)
    return pe[None].to(torch.float32)


def resample_grid(
    posemb: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix: int,
    method: str = "bilinear",
) -> torch.Tensor:
    """Resample a learned (1, prefix + gh * gw, D) position embedding to a new patch grid, on its device.

    The prefix (class-token) slots are kept as they are; the grid is interpolated in 2-D.

    ``method``:
      - ``"bilinear"``: corner-aligned linear interpolation. This is exactly what the official
        ``interpolate_posembed`` computes with ``scipy.ndimage.zoom(..., order=1)``.
      - ``"bicubic"``: timm's ``resample_abs_pos_embed`` default: half-pixel bicubic with ``antialias=True``
        (PyTorch's antialiased kernel, a = -0.5, which differs from the plain bicubic one even when enlarging).
      - ``"bicubic_plain"``: the plain bicubic kernel (a = -0.75, half-pixel, no antialias) to the new size, as
        transformers' ``interpolate_pos_encoding`` of ViT, DeiT, CLIP, SigLIP and DINOv2 computes it.
      - ``"bicubic_offset"``: the same kernel given the scale factor ``(n + 0.1) / m`` per axis instead of the size
        (the output is still ``n`` cells; the sampling points move by up to 0.1 of a cell): facebookresearch/dinov2's
        ``interpolate_pos_encoding`` with its default ``interpolate_offset=0.1`` (that code pairs the width's factor
        with the rows, so it agrees with this one on square grids only).
    """
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    prefix, grid = posemb[:, :num_prefix], posemb[:, num_prefix:]
    gh, gw = old_grid
    if grid.shape[1] != gh * gw:
        raise ValueError(f"position embedding has {grid.shape[1]} grid tokens, expected {gh}x{gw}")
    d = grid.shape[-1]
    x = grid.reshape(1, gh, gw, d).permute(0, 3, 1, 2).to(torch.float64)  # (1, D, gh, gw)
    if method == "bilinear":
        x = _zoom_linear(x, new_grid)
    elif method in ("bicubic", "bicubic_plain"):  # timm's antialiased kernel, or the plain one
        x = F.interpolate(x, size=new_grid, mode="bicubic", align_corners=False, antialias=method == "bicubic")
    elif method == "bicubic_offset":
        scale = ((new_grid[0] + 0.1) / gh, (new_grid[1] + 0.1) / gw)
        x = F.interpolate(x, scale_factor=scale, mode="bicubic", align_corners=False)
        assert tuple(x.shape[-2:]) == tuple(new_grid), (x.shape, new_grid)  # floor(m (n + 0.1) / m) == n
    else:
        raise ValueError(
            f"unknown position-embedding resampling {method!r} (bilinear, bicubic, bicubic_plain, bicubic_offset)"
        )
    x = x.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d).to(posemb.dtype)
    return torch.cat([prefix, x], dim=1)


def _zoom_linear(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Linear resampling with ``scipy.ndimage.zoom(order=1, grid_mode=False)`` semantics.

    Output pixel i sits at input coordinate i * (n_in - 1) / (n_out - 1): corners map onto corners.
    A one-pixel axis (either side) degenerates to a constant along that axis, as in scipy.
    """
    for axis, n_out in ((2, size[0]), (3, size[1])):
        n_in = x.shape[axis]
        if n_in == n_out:
            continue
        if n_in == 1 or n_out == 1:
            idx = torch.zeros(n_out, dtype=torch.long, device=x.device)
            x = x.index_select(axis, idx)
            continue
        coord = torch.arange(n_out, dtype=x.dtype, device=x.device) * ((n_in - 1) / (n_out - 1))
        lo = coord.floor().clamp(max=n_in - 2).long()
        w = (coord - lo).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = x.index_select(axis, lo) * (1 - w) + x.index_select(axis, lo + 1) * w
    return x


def grid_side(num_tokens: int) -> int:
    """Side of a square grid with ``num_tokens`` cells, or a ValueError."""
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise ValueError(f"{num_tokens} position tokens do not form a square grid")
    return side
