"""Resolution change on load: the official default (scipy zoom order 1) on non-square grids; the bicubic option
against Pillow's antialiased bicubic (timm's choice)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
import torch
from PIL import Image

import vitkit
from helpers import FIXTURES

CKPT = FIXTURES / "official_vit_tiny.npz"


@pytest.mark.parametrize("size", [(32, 48), (64, 24), (8, 40)])
def test_official_default_on_non_square_grids(size: tuple[int, int]) -> None:
    """load_pretrained(..., image_size=(H, W)) == official interpolate_posembed generalised to two zoom factors."""
    model = vitkit.load_pretrained(CKPT, image_size=size)
    pe = np.load(CKPT)["Transformer/posembed_input/pos_embedding"]
    gh, gw = size[0] // 8, size[1] // 8
    grid = scipy.ndimage.zoom(pe[0, 1:].reshape(4, 4, -1), (gh / 4, gw / 4, 1), order=1)
    ref = np.concatenate([pe[:, :1], grid.reshape(1, gh * gw, -1)], axis=1)
    assert model.pos_embed is not None
    np.testing.assert_allclose(model.pos_embed.detach().numpy(), ref, rtol=1e-6, atol=1e-7)
    assert model(torch.randn(1, 3, *size)).shape == (1, 5)


@pytest.mark.parametrize("size", [56, 16, (24, 40)])
def test_bicubic_is_the_antialiased_kernel_pillow_defines(size: int | tuple[int, int]) -> None:
    """pos_interpolation="bicubic" is timm's resample_abs_pos_embed: half-pixel bicubic, a = -0.5, antialias=True,
    the kernel PyTorch took from Pillow. So Pillow resizing each channel of the official grid (a float image)
    is an independent reference, enlarging (4x4 -> 7x7), shrinking (2x2) and both at once (3x5); the class slot
    is kept. (Hugging Face's interpolate_pos_encoding is plain bicubic, a = -0.75, without antialias: not this.)
    """
    model = vitkit.load_pretrained(CKPT, image_size=size, pos_interpolation="bicubic")
    pe = np.load(CKPT)["Transformer/posembed_input/pos_embedding"]  # (1, 1 + 4 * 4, D)
    grid = pe[0, 1:].reshape(4, 4, -1).astype(np.float32)
    gh, gw = model.cfg.grid_size
    ref = np.stack(
        [
            np.asarray(Image.fromarray(grid[..., c]).resize((gw, gh), Image.Resampling.BICUBIC))
            for c in range(grid.shape[-1])
        ],
        axis=-1,
    )
    assert model.pos_embed is not None
    out = model.pos_embed.detach().numpy()
    np.testing.assert_array_equal(out[:, :1], pe[:, :1])
    np.testing.assert_allclose(out[0, 1:].reshape(gh, gw, -1), ref, rtol=0, atol=1e-6 * np.abs(grid).max())
