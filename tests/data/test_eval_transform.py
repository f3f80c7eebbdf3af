"""The batch jobs' evaluation transform: the reference path is Preprocess.to_tensor of the full decode bit for
bit; the fast path (reduced-scale JPEG decoding, PyTorch's antialiased resize) stays within resampling error of
it on real photos; uint8 pixels normalised on the device (a GPU job's path) are the float path bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess, normalize
from vitkit.data.eval_transform import EvalTransform, Normalizer, reduced_scale
from vitkit.errors import DataError
from vitkit.images import load_image, open_lazy


def photo(path: Path, width: int, height: int) -> Path:
    """A JPEG of scikit-learn's two sample photos tiled 3 x 3 (natural detail at native resolution, 1920 x 1281),
    resized to ``width`` x ``height``."""
    from sklearn.datasets import load_sample_image

    a, b = load_sample_image("china.jpg"), load_sample_image("flower.jpg")
    rows = [np.concatenate(r, axis=1) for r in ((a, b, a), (b, a, b), (a, b, a))]
    img = Image.fromarray(np.concatenate(rows, axis=0))
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.LANCZOS)
    img.save(path, quality=90)
    return path


def pixels(x: torch.Tensor, pre: Preprocess) -> np.ndarray:
    """A model input (C, H, W) back in 0..255 pixel units (H, W, C), unrounded."""
    mean, std = np.asarray(pre.mean), np.asarray(pre.std)
    return (x.permute(1, 2, 0).double().numpy() * std + mean) * 255.0


PRES = [
    Preprocess(image_size=224),
    Preprocess(image_size=224, resize="crop", crop_pct=0.875, interpolation="bicubic"),
    Preprocess(image_size=(160, 224)),
]


@pytest.mark.parametrize("pre", PRES)
def test_reference_path_is_the_full_decode_bit_for_bit(tmp_path: Path, pre: Preprocess) -> None:
    jpg = photo(tmp_path / "p.jpg", 700, 460)
    png = tmp_path / "p.png"
    Image.open(jpg).save(png)
    ref = EvalTransform(pre, reference=True)
    for path in (jpg, png):
        want = pre.to_tensor(load_image(path))
        assert torch.equal(ref(open_lazy(path)), want) and torch.equal(ref(load_image(path)), want)
    assert not ref.lazy and EvalTransform(pre).lazy


SIZES = [(1920, 1281), (1000, 700), (3000, 2000), (500, 375)]


def test_the_photos_cover_every_decode_scale() -> None:
    assert {reduced_scale(*size, pre) for size in SIZES for pre in PRES} == {1, 2, 4, 8}


@pytest.mark.parametrize("pre", PRES)
@pytest.mark.parametrize("size", SIZES)
def test_fast_path_is_within_resampling_error_of_the_full_decode(
    tmp_path: Path, pre: Preprocess, size: tuple[int, int]
) -> None:
    path = photo(tmp_path / "p.jpg", *size)
    got = pixels(EvalTransform(pre)(open_lazy(path)), pre)
    full = load_image(path)
    want = pixels(pre.to_tensor(full), pre)
    err = np.abs(got - want)
    if reduced_scale(*size, pre) == 1:  # full-scale decode, PyTorch's resize: Pillow's pixels within rounding
        assert err.max() <= 2.001 and err.mean() < 0.05
        return
    # resampling error: what two standard filters disagree by on the same decode (Pillow bilinear vs bicubic)
    swapped = "bicubic" if pre.interpolation == "bilinear" else "bilinear"
    filters = np.abs(pixels(Preprocess(**{**pre.to_dict(), "interpolation": swapped}).to_tensor(full), pre) - want)
    assert err.mean() < 1.0 and np.percentile(err, 99) <= 6.001  # in 0..255 pixel levels
    assert err.mean() < 0.7 * filters.mean() and np.percentile(err, 99) <= np.percentile(filters, 99)


def test_greyscale_models_and_other_formats_take_the_reference_path(tmp_path: Path) -> None:
    jpg = photo(tmp_path / "p.jpg", 1920, 1281)
    pre = Preprocess(image_size=8, grayscale=True)
    assert torch.equal(EvalTransform(pre)(open_lazy(jpg)), pre.to_tensor(load_image(jpg)))
    gif = tmp_path / "p.gif"
    Image.open(jpg).convert("P").save(gif)
    rgb = Preprocess(image_size=32)
    assert torch.equal(EvalTransform(rgb)(open_lazy(gif)), rgb.to_tensor(load_image(gif)))


# ---- uint8 pixels, normalised on the device ---------------------------------------------------------------

NORMS = [
    Preprocess(),  # inception: [-1, 1]
    Preprocess(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    Preprocess(mean=(0.1, 0.7, 0.33), std=(0.11, 0.9, 0.013)),
    Preprocess(mean=(0.45, 0.45, 0.45), std=(0.27, 0.27, 0.27), grayscale=True),
]


def every_value(channels: int) -> np.ndarray:
    """(256, 5, C) uint8: every value in every channel."""
    return np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, 5, channels)).copy()


@pytest.mark.parametrize("pre", NORMS)
def test_normalising_uint8_is_the_float_path_for_every_value_bit_for_bit(pre: Preprocess) -> None:
    """The engine normalises a GPU job's uint8 batch with the same float32 operations the workers apply on the
    CPU (preprocess.normalize): every one of the 256 values of every channel gives the same bits, contiguous or
    not, and the constants made for a device are reused."""
    arr = every_value(pre.channels)
    want = normalize(arr, pre._mean, pre._std)  # (C, 256, 5)
    chw = torch.from_numpy(arr).permute(2, 0, 1)[None]  # (1, C, 256, 5), not contiguous
    norm = Normalizer(pre)
    for x in (chw, chw.contiguous(), torch.cat([chw, chw.flip(2)])):
        got = norm(x)
        assert got.dtype == torch.float32 and torch.equal(got[0], want)
    assert len(norm._consts) == 1 and torch.equal(Normalizer(pre)(chw)[0], want)
    with pytest.raises(ValueError, match="uint8"):
        norm(chw.float())


@pytest.mark.parametrize("pre", PRES)
def test_uint8_transform_then_normalised_is_the_float_transform_bit_for_bit(tmp_path: Path, pre: Preprocess) -> None:
    """A GPU job's worker stops before normalising (uint8=True, 1/4 of the bytes); normalised on the device
    it is what the CPU's transform gives, on the reference path and the fast path at every decode scale."""
    for size in SIZES:
        path = photo(tmp_path / f"p{size[0]}.jpg", *size)
        for reference in (True, False):
            float_path = EvalTransform(pre, reference=reference)
            u8 = EvalTransform(pre, reference=reference, uint8=True)(open_lazy(path))
            assert u8.dtype == torch.uint8 and u8.shape == (3, *pre.image_size)
            assert torch.equal(Normalizer(pre)(u8[None])[0], float_path(open_lazy(path)))
    png = tmp_path / "p.png"
    Image.open(path).save(png)
    u8 = EvalTransform(pre, uint8=True)(load_image(png))
    assert torch.equal(Normalizer(pre)(u8[None])[0], pre.to_tensor(load_image(png)))


_LINE_RSS = """
import io, sys
import numpy as np
from PIL import Image
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.images import open_lazy
from vitkit.data.eval_transform import EvalTransform
t = EvalTransform(Preprocess(image_size=224, resize="crop", crop_pct=0.875), reference=False)
def hwm():  # this process's peak RSS in MiB (VmHWM: getrusage's maxrss carries the parent's over exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
base = hwm()
x = t(open_lazy(sys.argv[1]))
print(hwm() - base)
"""


@pytest.mark.parametrize("size", [(1000, 1), (1, 1000)])
def test_a_line_of_pixels_is_not_resized_whole_on_the_fast_path(tmp_path: Path, size: tuple[int, int]) -> None:
    """A 1000x1 JPEG under a 224 crop at 0.875 (a 256000x256 intermediate, +393 MiB, before): the fast path
    resizes only the crop's box, giving the reference's pixels, in no more memory than an ordinary photo."""
    import os
    import subprocess
    import sys

    from helpers import SRC

    path = tmp_path / "line.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=95)
    pre = Preprocess(image_size=224, resize="crop", crop_pct=0.875)
    fast = EvalTransform(pre, reference=False)(open_lazy(path))
    ref = EvalTransform(pre, reference=True)(open_lazy(path))
    torch.testing.assert_close(fast, ref, atol=0, rtol=0)
    u8 = EvalTransform(pre, reference=False, uint8=True)(open_lazy(path))  # a GPU job's worker: uint8, unnormalised
    assert u8.dtype == torch.uint8 and torch.equal(Normalizer(pre)(u8[None])[0], fast)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    photo = tmp_path / "photo.jpg"
    Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(photo)
    grew = {}
    for image in (photo, path):  # the photo: what the first transform costs anyway (torch's kernels, libjpeg)
        res = subprocess.run([sys.executable, "-c", _LINE_RSS, str(image)], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        grew[image.name] = float(res.stdout)
    assert grew["line.jpg"] < grew["photo.jpg"] + 32, f"a line of pixels grew the RSS by {grew} MB"


@pytest.mark.parametrize("reference", [False, True])
def test_a_truncated_jpeg_is_one_data_error_naming_it_on_either_path(tmp_path: Path, reference: bool) -> None:
    """The fast path decodes through images.decode_scaled (once its own copy of the simplejpeg call): a JPEG whose
    header reads but whose data is cut is the same one-line DataError naming the file as the reference decode."""
    data = photo(tmp_path / "p.jpg", 1000, 700).read_bytes()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.jpg: corrupt or truncated"):
        EvalTransform(Preprocess(image_size=224), reference=reference)(open_lazy(cut))
