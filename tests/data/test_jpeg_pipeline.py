"""The training sample path for JPEG files: the crop box is drawn from the header's size, the JPEG is
decoded at 1/2, 1/4 or 1/8 scale when the crop allows (libjpeg's DCT scaling through ``Image.draft``),
and downscaled crops go through PyTorch's antialiased kernel. Checked against Pillow's full decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import decode_crop, decode_crop_rgb, is_lazy_jpeg, normalize, open_lazy
from vitkit.data.datasets import open_dataset
from vitkit.data.loader import TrainLoader
from vitkit.data.transforms import TrainTransform, inception_crop_box, sample_rng
from vitkit.errors import DataError


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of photo-sized JPEGs cut from scikit-learn's two sample photos (500x375, 375x500)."""
    from sklearn.datasets import load_sample_images

    root = tmp_path_factory.mktemp("photos")
    photos = load_sample_images().images
    for i in range(6):
        img = Image.fromarray(photos[i % 2][20 + 10 * i : 395 + 10 * i, 40 * i : 40 * i + 500])  # (375, 500)
        if i % 3 == 2:
            img = img.transpose(Image.Transpose.ROTATE_90)
        (root / "train" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        img.save(root / "train" / f"c{i % 2}" / f"{i}.jpg", quality=90)
    return root


def moved_box(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` moved by 2 px along each axis where it fits (right/down, else left/up)."""
    dx = 2 if box[2] + 2 <= width else (-2 if box[0] >= 2 else 0)
    dy = 2 if box[3] + 2 <= height else (-2 if box[1] >= 2 else 0)
    return box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy


def _levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def test_reduced_scale_decode_takes_the_same_region(photo_folder: Path) -> None:
    ds = open_dataset(str(photo_folder), "train")
    size = 64
    tf = TrainTransform((size, size), flip=False)
    checked = 0
    for i in range(len(ds)):
        full = Image.open(ds.paths[i]).convert("RGB")
        for epoch in range(8):
            box = inception_crop_box(full.width, full.height, sample_rng(0, epoch, i), tf.crop_scale, tf.crop_ratio)
            scale = next((s for s in (8, 4, 2) if min(box[2] - box[0], box[3] - box[1]) >= s * size), 1)
            if scale == 1:
                continue
            img, region = decode_crop(open_lazy(ds.paths[i]), box, (size, size))
            assert img.size == (-(-full.width // scale), -(-full.height // scale))  # decoded at 1/scale
            assert region == tuple(v / scale for v in box)
            arr, region_rgb = decode_crop_rgb(open_lazy(ds.paths[i]), box, (size, size))
            assert np.array_equal(arr, np.asarray(img)) and region_rgb == region  # simplejpeg = Pillow's draft
            ours = np.asarray(tf.augment(ds.lazy_item(i)[0], sample_rng(0, epoch, i)))
            ref = np.asarray(full.resize((size, size), Image.Resampling.BILINEAR, box=box))
            moved = moved_box(box, full.width, full.height)
            other = np.asarray(full.resize((size, size), Image.Resampling.BILINEAR, box=moved))
            # the same region: far closer to the full decode's crop than that crop is to itself moved by 2 px
            assert _levels(ours, ref) < 3.0 and _levels(ours, ref) < 0.4 * _levels(other, ref)
            checked += 1
    assert checked >= 10


def test_full_scale_decode_is_bit_identical(photo_folder: Path) -> None:
    """When the crop allows no reduction the lazy path decodes the same pixels as Pillow's full decode."""
    ds = open_dataset(str(photo_folder), "train")
    for size, interp in (((300, 300), "bilinear"), ((96, 128), "bicubic"), ((48, 48), "nearest")):
        tf = TrainTransform(size, crop_scale=(0.05, 0.3), interpolation=interp)
        for i in range(len(ds)):
            lazy = ds.lazy_item(i)[0]
            assert is_lazy_jpeg(lazy)
            box = inception_crop_box(lazy.width, lazy.height, sample_rng(0, 0, i), tf.crop_scale, tf.crop_ratio)
            if min(box[2] - box[0], box[3] - box[1]) >= 2 * min(size):
                continue
            assert torch.equal(tf(lazy, sample_rng(0, 0, i)), tf(ds[i][0], sample_rng(0, 0, i)))


def test_jpeg_array_decode_equals_pillow(photo_folder: Path) -> None:
    ds = open_dataset(str(photo_folder), "train")
    for i in range(len(ds)):
        full = np.asarray(ds[i][0])
        arr, region = decode_crop_rgb(ds.lazy_item(i)[0], (0, 0, 10, 10), (224, 224))  # full scale
        assert np.array_equal(arr, full) and region == (0.0, 0.0, 10.0, 10.0)


@pytest.mark.parametrize("grayscale", [False, True])
@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
def test_torch_resize_matches_pillow(photo_folder: Path, grayscale: bool, interp: str) -> None:
    """Downscaled crops resized by PyTorch's antialiased kernel equal Pillow's resize of the same box
    except where Pillow's filter also reads pixels just outside the box (the outermost rows/columns)."""
    ds = open_dataset(str(photo_folder), "train")
    tf = TrainTransform((64, 48), interpolation=interp, grayscale=grayscale, crop_scale=(0.2, 0.6))
    for i in range(len(ds)):
        img = ds[i][0]  # decoded: full scale, integer box
        fast = tf(img, sample_rng(3, 1, i))
        ref = tf._norm.to_tensor(tf.augment(img, sample_rng(3, 1, i)))  # Pillow throughout
        assert fast.shape == ref.shape == (1 if grayscale else 3, 64, 48) and fast.is_contiguous()
        diff = (fast - ref).abs() * 0.5 * 255  # in 0..255 levels (std 0.5)
        assert float(diff.mean()) < 0.2
        assert float(diff[:, 1:-1, 1:-1].max()) <= 3.01  # rounding inside


def test_normalize_is_bit_identical_to_broadcasting() -> None:
    rng = np.random.default_rng(0)
    mean = np.asarray([0.485, 0.456, 0.406], np.float32)
    std = np.asarray([0.229, 0.224, 0.225], np.float32)
    for shape in [(7, 5, 3), (9, 4)]:
        arr = rng.integers(0, 256, shape, dtype=np.uint8)
        x = np.asarray(arr, np.float32) / 255.0
        x = x[:, :, None] if x.ndim == 2 else x
        c = x.shape[2]
        ref = np.ascontiguousarray(((x - mean[:c]) / std[:c]).transpose(2, 0, 1))
        assert np.array_equal(normalize(arr, mean, std).numpy(), ref)


def test_non_jpeg_and_cmyk_decode_fully(tmp_path: Path, sample_jpeg: Path) -> None:
    photo = Image.open(sample_jpeg).convert("RGB").resize((200, 150))
    (tmp_path / "train" / "a").mkdir(parents=True)
    photo.save(tmp_path / "train" / "a" / "0.png")
    photo.convert("CMYK").save(tmp_path / "train" / "a" / "1.jpg")
    ds = open_dataset(str(tmp_path), "train")
    tf = TrainTransform((64, 64))
    for i in range(2):
        img = ds.lazy_item(i)[0]
        assert not is_lazy_jpeg(img) and img.mode == "RGB"
        assert torch.equal(tf(img, sample_rng(0, 0, i)), tf(ds[i][0], sample_rng(0, 0, i)))


def test_truncated_jpeg_is_named_by_the_loader(tmp_path: Path, sample_jpeg: Path) -> None:
    (tmp_path / "train" / "a").mkdir(parents=True)
    data = sample_jpeg.read_bytes()
    for i in range(3):
        (tmp_path / "train" / "a" / f"{i}.jpg").write_bytes(data)
    bad = tmp_path / "train" / "a" / "1.jpg"
    bad.write_bytes(data[: len(data) // 2])
    ds = open_dataset(str(tmp_path), "train")
    assert is_lazy_jpeg(ds.lazy_item(1)[0])  # the header reads fine: the error comes with the decode
    loader = TrainLoader(ds, TrainTransform((32, 32)), global_batch=3, seed=0)
    with pytest.raises(DataError, match=r"1\.jpg: corrupt or truncated"):
        list(loader.epoch(0))
