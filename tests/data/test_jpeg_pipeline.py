"""The training sample path for JPEG files: the crop box is drawn from the header's size, the JPEG is
decoded at 1/2, 1/4 or 1/8 scale when the crop allows (libjpeg's DCT scaling through ``Image.draft``),
and downscaled crops go through PyTorch's antialiased kernel. Checked against Pillow's full decode."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import normalize
from vitkit.data.datasets import open_dataset
from vitkit.data.loader import TrainLoader
from vitkit.data.transforms import (
    REDUCED_DECODE_PIXELS,
    TrainTransform,
    inception_crop_box,
    pillow_resize,
    sample_rng,
)
from vitkit.errors import DataError
from vitkit.images import EncodedJpeg, ImageTooLarge, decode_crop, decode_crop_rgb, open_lazy


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
            draft = Image.open(ds.paths[i])
            draft.draft("RGB", (full.width // scale, full.height // scale))  # Pillow's DCT-scaled decode
            assert np.array_equal(np.asarray(img), np.asarray(draft.convert("RGB")))
            arr, region_rgb = decode_crop_rgb(open_lazy(ds.paths[i]), box, (size, size))
            assert np.array_equal(arr, np.asarray(img)) and region_rgb == region
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
            assert isinstance(lazy, EncodedJpeg)
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
        assert not isinstance(img, EncodedJpeg) and img.mode == "RGB"
        assert torch.equal(tf(img, sample_rng(0, 0, i)), tf(ds[i][0], sample_rng(0, 0, i)))


def test_truncated_jpeg_is_named_by_the_loader(tmp_path: Path, sample_jpeg: Path) -> None:
    (tmp_path / "train" / "a").mkdir(parents=True)
    data = sample_jpeg.read_bytes()
    for i in range(3):
        (tmp_path / "train" / "a" / f"{i}.jpg").write_bytes(data)
    bad = tmp_path / "train" / "a" / "1.jpg"
    bad.write_bytes(data[: len(data) // 2])
    ds = open_dataset(str(tmp_path), "train")
    assert isinstance(ds.lazy_item(1)[0], EncodedJpeg)  # the header reads fine: the error comes with the decode
    loader = TrainLoader(ds, TrainTransform((32, 32)), global_batch=3, seed=0)
    with pytest.raises(DataError, match=r"1\.jpg: corrupt or truncated"):
        list(loader.epoch(0))


def _denormalised(x: torch.Tensor) -> np.ndarray:
    """A (C, H, W) tensor normalised with mean = std = 0.5 back to (H, W, C) levels 0..255."""
    return (x.numpy().transpose(1, 2, 0) * 0.5 + 0.5) * 255.0


def test_enlarged_crops_match_pillow(photo_folder: Path) -> None:
    """Crops smaller than the output (enlarged) also go through PyTorch's kernel for an RGB model: Pillow's
    bilinear filter on the same box, within rounding (Pillow also reads one pixel outside the box)."""
    ds = open_dataset(str(photo_folder), "train")
    tf = TrainTransform((160, 160), crop_scale=(0.02, 0.1), flip=False)
    for i in range(len(ds)):
        full = Image.open(ds.paths[i]).convert("RGB")
        box = inception_crop_box(full.width, full.height, sample_rng(5, 0, i), tf.crop_scale, tf.crop_ratio)
        assert box[2] - box[0] < 160 and box[3] - box[1] < 160  # an enlargement
        ours = _denormalised(tf(ds.lazy_item(i)[0], sample_rng(5, 0, i)))
        ref = np.asarray(full.resize((160, 160), Image.Resampling.BILINEAR, box=box), dtype=np.float64)
        diff = np.abs(ours - ref)
        assert float(diff.mean()) < 0.2 and float(diff[2:-2, 2:-2].max()) <= 2.01


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
def test_pillow_resize_of_a_window_is_pillows_resize(photo_folder: Path, interp: str) -> None:
    """Pillow handed only the pixels around the region gives exactly its resize of the whole image, for
    whole-pixel and fractional regions, enlarged and reduced, at the image's edges too."""
    arr = np.asarray(Image.open(next(photo_folder.glob("train/c0/*.jpg"))).convert("RGB"))
    h, w = arr.shape[:2]
    resample = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}[interp]
    rng = np.random.default_rng(0)
    regions = [(0.0, 0.0, float(w), float(h)), (0.0, 0.0, 40.5, 30.25), (w - 33.375, h - 20.0, float(w), float(h))]
    for _ in range(30):
        left, top = rng.uniform(0, w - 20) // 0.125 * 0.125, rng.uniform(0, h - 20) // 0.125 * 0.125
        regions.append((left, top, rng.uniform(left + 8, w) // 1, rng.uniform(top + 8, h) // 0.5 * 0.5))
    for region in regions:
        for size in ((64, 48), (224, 224)):
            ref = np.asarray(Image.fromarray(arr).resize((size[1], size[0]), resample, box=region))
            assert np.array_equal(pillow_resize(arr, region, size, interp), ref), region


def test_encoded_jpeg_decodes_as_pillow(tmp_path: Path, photo_folder: Path) -> None:
    """Greyscale and RGB JPEGs are read undecoded; decoding them gives Pillow's pixels in Pillow's mode,
    and the training transform gives what it gives for the image Pillow decoded."""
    src = Image.open(next(photo_folder.glob("train/c1/*.jpg")))
    (tmp_path / "train" / "a").mkdir(parents=True)
    src.convert("L").save(tmp_path / "train" / "a" / "grey.jpg", quality=90)
    src.save(tmp_path / "train" / "a" / "rgb.jpg", quality=75, subsampling=1)  # 4:2:2
    ds = open_dataset(str(tmp_path), "train")
    for i, mode in enumerate(["L", "RGB"]):
        lazy = ds.lazy_item(i)[0]
        assert isinstance(lazy, EncodedJpeg) and lazy.mode == mode and lazy.size == src.size
        pil = Image.open(ds.paths[i])
        img, region = decode_crop(lazy, (0, 0, 10, 10), (64, 64))
        assert img.mode == mode and np.array_equal(np.asarray(img), np.asarray(pil)) and region == (0, 0, 10, 10)
        for grey in (False, True):
            tf = TrainTransform((64, 64), grayscale=grey, crop_scale=(0.05, 0.2))
            for k in range(4):
                assert torch.equal(tf(ds.lazy_item(i)[0], sample_rng(0, k, i)), tf(ds[i][0], sample_rng(0, k, i)))


def test_large_jpegs_decode_reduced_on_the_same_region(tmp_path: Path) -> None:
    """Above REDUCED_DECODE_PIXELS the trainer's path decodes at 1/2..1/8 scale when the crop allows: the
    same region as Pillow's full decode (far closer to it than that crop moved by 2 px)."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    photo = Image.new("RGB", (1400, 1000))
    for k, (x, y) in enumerate((x, y) for y in (0, 427, 854) for x in (0, 640, 1280)):  # photo detail, not upscaled
        photo.paste(Image.fromarray(photos[k % 2]), (x, y))
    assert REDUCED_DECODE_PIXELS <= 1400 * 1000
    photo.save(tmp_path / "big.jpg", quality=90)
    lazy = open_lazy(tmp_path / "big.jpg")
    full = Image.open(tmp_path / "big.jpg").convert("RGB")
    tf = TrainTransform((160, 160), flip=False, crop_scale=(0.2, 1.0))
    reduced = 0
    for k in range(6):
        box = inception_crop_box(1400, 1000, sample_rng(0, k, 0), tf.crop_scale, tf.crop_ratio)
        reduced += min(box[2] - box[0], box[3] - box[1]) >= 2 * 160
        ours = _denormalised(tf(lazy, sample_rng(0, k, 0)))
        ref = np.asarray(full.resize((160, 160), Image.Resampling.BILINEAR, box=box), dtype=np.float64)
        moved = moved_box(box, 1400, 1000)
        other = np.asarray(full.resize((160, 160), Image.Resampling.BILINEAR, box=moved), dtype=np.float64)
        assert _levels(ours, ref) < 3.0 and _levels(ours, ref) < 0.4 * _levels(other, ref)
    assert reduced >= 4


def test_webdataset_jpegs_take_the_lazy_path(tmp_path: Path, photo_folder: Path) -> None:
    """JPEG members of a shard are read undecoded and give the same tensors as the same files in an
    ImageFolder; other members decode as before; a truncated member is named as shard:member."""
    folder = open_dataset(str(photo_folder), "train")
    shard = tmp_path / "train-0000.tar"
    with tarfile.open(shard, "w") as tar:
        for i, path in enumerate(folder.paths):
            tar.add(path, arcname=f"s{i:03d}.jpg")
            _add(tar, f"s{i:03d}.cls", str(int(folder.labels[i])).encode())
        buf = io.BytesIO()
        Image.open(folder.paths[0]).save(buf, format="PNG")
        _add(tar, "png.png", buf.getvalue())
        _add(tar, "png.cls", b"0")
        _add(tar, "cut.jpg", Path(folder.paths[1]).read_bytes()[:5000])
        _add(tar, "cut.cls", b"1")
    ds = open_dataset(str(shard), "train")
    tf = TrainTransform((64, 64))
    for i in range(len(folder)):
        lazy, label = ds.lazy_item(i)
        assert isinstance(lazy, EncodedJpeg) and label == folder.labels[i]
        assert torch.equal(tf(lazy, sample_rng(0, 0, i)), tf(folder.lazy_item(i)[0], sample_rng(0, 0, i)))
    png, _ = ds.lazy_item(len(folder))
    assert isinstance(png, Image.Image) and np.array_equal(np.asarray(png), np.asarray(folder[0][0]))
    with pytest.raises(DataError, match=r"train-0000\.tar:cut\.jpg: corrupt or truncated"):
        tf(ds.lazy_item(len(folder) + 1)[0], sample_rng(0, 0, 0))


def test_open_lazy_refuses_what_load_image_refuses(
    tmp_path: Path, photo_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DataError, match="no such file"):
        open_lazy(tmp_path / "missing.jpg")
    with pytest.raises(DataError, match="is a directory"):
        open_lazy(tmp_path)
    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty file \(0 bytes\)"):
        open_lazy(tmp_path / "empty.jpg")
    (tmp_path / "junk.jpg").write_bytes(b"\xff\xd8 not a JPEG at all")
    with pytest.raises(DataError, match=r"junk\.jpg: "):
        open_lazy(tmp_path / "junk.jpg")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the header's size is checked before decoding
    with pytest.raises(ImageTooLarge, match=r"exceeds the limit of 1000 pixels"):
        open_lazy(next(photo_folder.glob("train/c0/*.jpg")))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
