from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import meta_model
from vitkit.models.cost import cost_table
from vitkit.models.posembed import resample_grid, sincos_2d


@pytest.mark.parametrize(
    ("old", "new"),
    [((14, 14), (24, 24)), ((24, 24), (14, 14)), ((7, 7), (12, 12)), ((4, 6), (9, 3)), ((5, 5), (1, 4))],
)
def test_bilinear_resampling_is_scipy_zoom_order_1(old: tuple[int, int], new: tuple[int, int]) -> None:
    """The official interpolate_posembed: scipy.ndimage.zoom(grid, zoom, order=1), class token kept."""
    rng = np.random.default_rng(0)
    grid = rng.standard_normal((*old, 8)).astype(np.float32)
    ref = scipy.ndimage.zoom(grid, (new[0] / old[0], new[1] / old[1], 1), order=1)
    assert ref.shape[:2] == new
    cls = torch.randn(1, 1, 8)
    pe = torch.cat([cls, torch.from_numpy(grid.reshape(1, -1, 8))], dim=1)
    out = resample_grid(pe, old, new, num_prefix=1)
    assert torch.equal(out[:, :1], cls)
    np.testing.assert_allclose(out[0, 1:].numpy().reshape(*new, 8), ref, rtol=1e-6, atol=1e-6)


def test_bicubic_resampling_keeps_constant_fields() -> None:
    pe = torch.full((1, 16, 4), 0.7)
    out = resample_grid(pe, (4, 4), (7, 5), num_prefix=0, method="bicubic")
    torch.testing.assert_close(out, torch.full((1, 35, 4), 0.7, dtype=out.dtype))


def test_sincos_2d_structure() -> None:
    pe = sincos_2d((6, 5), 32)[0]  # (30, 32)
    grid = pe.reshape(6, 5, 32)
    # first half depends on the column only, second half on the row only
    assert torch.allclose(grid[0, :, :16], grid[3, :, :16])
    assert torch.allclose(grid[:, 0, 16:], grid[:, 4, 16:])
    # sin^2 + cos^2 = 1 per frequency
    torch.testing.assert_close(grid[..., :8] ** 2 + grid[..., 8:16] ** 2, torch.ones(6, 5, 8))
    assert torch.allclose(grid[0, 0], torch.tensor([0.0] * 8 + [1.0] * 8 + [0.0] * 8 + [1.0] * 8))


@pytest.mark.parametrize(("name", "size"), [("B/16", 224), ("S/32", 384), ("Ti/16", (224, 320)), ("L/14", 224)])
def test_macs_equal_torch_flop_counter(name: str, size: int | tuple[int, int]) -> None:
    model = meta_model(name, image_size=size)
    macs = sum(r.macs for r in cost_table(model))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, *model.cfg.image_size, device="meta"))
    assert macs == counter.get_total_flops() // 2


def test_b16_cost_matches_published_figure() -> None:
    model = meta_model("B/16")
    rows = cost_table(model)
    assert abs(sum(r.macs for r in rows) / 1e9 - 17.56) < 0.01  # 17.6 GMACs = 35.1 GFLOPs
    assert sum(r.params for r in rows) == 86_567_656
