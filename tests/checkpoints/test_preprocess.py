from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import Preprocess, load_image
from vitkit.errors import DataError


def test_bad_files_are_named(tmp_path: Path, sample_jpeg: Path) -> None:
    empty = tmp_path / "empty.jpg"
    empty.touch()
    text = tmp_path / "text.png"
    text.write_text("hello")
    trunc = tmp_path / "trunc.jpg"
    trunc.write_bytes(sample_jpeg.read_bytes()[:2000])
    for path, msg in [
        (empty, "empty file"),
        (text, "not a recognised image"),
        (trunc, "corrupt or truncated"),
        (tmp_path / "absent.jpg", "no such file"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(DataError, match=msg) as info:
            load_image(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "CMYK", "I;16", "1"])
def test_any_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)).convert(mode)
    path = tmp_path / ("x.tiff" if mode in ("I;16", "CMYK") else "x.png")
    img.save(path)
    x = Preprocess(image_size=16)(path)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert x.min() >= -1.0 and x.max() <= 1.0


def test_normalisation_and_resize_modes(sample_jpeg: Path) -> None:
    white = Image.new("RGB", (40, 20), (255, 255, 255))
    x = Preprocess(image_size=8)(white)
    torch.testing.assert_close(x, torch.ones(3, 8, 8))  # (1 - 0.5) / 0.5
    pre = Preprocess(image_size=(16, 24), resize="crop", crop_pct=0.875, interpolation="bicubic")
    assert pre(sample_jpeg).shape == (3, 16, 24)
    # crop keeps the aspect ratio: a left-black/right-white image stays split in the middle
    half = Image.new("RGB", (80, 40))
    half.paste((255, 255, 255), (40, 0, 80, 40))
    out = Preprocess(image_size=20, resize="crop")(half)
    assert out[:, :, 0].max() < -0.9 and out[:, :, -1].min() > 0.9
    assert Preprocess(image_size=8, grayscale=True)(white).shape == (1, 8, 8)


def test_invalid_options() -> None:
    with pytest.raises(ValueError, match="resize"):
        Preprocess(resize="stretch")
    with pytest.raises(ValueError, match="crop_pct"):
        Preprocess(crop_pct=0)
    assert Preprocess.from_dict(Preprocess(image_size=12).to_dict()) == Preprocess(image_size=12)
