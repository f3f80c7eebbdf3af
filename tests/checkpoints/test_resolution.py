"""Resolution change on load: the official default (scipy zoom order 1) on non-square grids, bicubic option."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
import torch

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


def test_bicubic_is_an_option_and_differs() -> None:
    bilinear = vitkit.load_pretrained(CKPT, image_size=56)
    bicubic = vitkit.load_pretrained(CKPT, image_size=56, pos_interpolation="bicubic")
    assert bilinear.pos_embed is not None and bicubic.pos_embed is not None
    torch.testing.assert_close(bicubic.pos_embed[:, :1], bilinear.pos_embed[:, :1])  # class slot kept
    assert (bicubic.pos_embed - bilinear.pos_embed).abs().max() > 1e-4
