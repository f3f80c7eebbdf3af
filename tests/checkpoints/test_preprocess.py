from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import DataError
from vitkit.images import load_image


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


# ---- centre crop: only the crop's source box is resized, and hostile shapes are refused ------------------------


def crop_geometry(pre: Preprocess, width: int, height: int) -> tuple[int, int, int, int]:
    """timm/DeiT's eval transform: the size (new_w, new_h) the whole image is resized to (shorter side
    size / crop_pct, at least the target), and the offset (left, top) of the centre crop in it."""
    H, W = pre.image_size
    scale = max(H / height, W / width) / pre.crop_pct
    new_w, new_h = max(W, round(width * scale)), max(H, round(height * scale))
    return new_w, new_h, (new_w - W) // 2, (new_h - H) // 2


def full_resize_then_crop(pre: Preprocess, img: Image.Image) -> Image.Image:
    """The reference, as Pillow spells timm's transform: the whole image resized, then the centre cut out
    (what vitkit's crop did before it resized only the crop's box)."""
    H, W = pre.image_size
    new_w, new_h, left, top = crop_geometry(pre, img.width, img.height)
    full = img.resize((new_w, new_h), {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1}[pre.interpolation])
    return full.crop((left, top, left + W, top + H))


def ordinary_images(sample_jpeg: Path) -> list[Image.Image]:
    """A photo, a photo's corner in portrait, random noise in several sizes (up- and downscaled), greyscale."""
    rng = np.random.default_rng(3)
    photo = Image.open(sample_jpeg).convert("RGB")
    sizes = [(97, 61), (20, 33), (300, 301)]
    noise = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    grey = Image.fromarray(rng.integers(0, 256, (50, 75), dtype=np.uint8))
    return [photo, photo.crop((0, 0, 200, 333)), *noise, grey]


CROPS = [((224, 224), 0.875), ((32, 48), 0.9), ((40, 40), 1.0)]


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize(("size", "crop_pct"), CROPS)
def test_crop_equals_full_resize_then_crop(
    sample_jpeg: Path, interpolation: str, size: tuple[int, int], crop_pct: float
) -> None:
    """Resizing only the crop's box gives the pixels of the full resize-then-crop: the same sample positions
    and filter support. Pillow takes a box in float32, so a sample position can move by ~1e-5 px; where the
    fixed-point sum is on a rounding tie that flips the last grey level (of 3% of the pixels at worst, a photo
    at 224 px bilinear: 5/3 scale puts many sums on ties)."""
    pre = Preprocess(image_size=size, resize="crop", crop_pct=crop_pct, interpolation=interpolation)
    for img in ordinary_images(sample_jpeg):
        got = np.asarray(pre.resized(img), dtype=np.int16)
        want = np.asarray(full_resize_then_crop(pre, img), dtype=np.int16)
        assert got.shape == want.shape
        diff = np.abs(got - want)
        assert diff.max() <= 1, (img.size, diff.max())
        assert (diff > 0).mean() < 0.05, (img.size, (diff > 0).mean())


def coordinate_image(width: int, height: int) -> Image.Image:
    """Each pixel holds its own coordinates: R, G = x, y mod 256; B = x // 256 + 16 (y // 256)."""
    y, x = np.mgrid[:height, :width]
    return Image.fromarray(np.stack([x % 256, y % 256, x // 256 + 16 * (y // 256)], -1).astype(np.uint8))


def coordinates(img: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(img, dtype=np.int64)
    return a[..., 0] + 256 * (a[..., 2] % 16), a[..., 1] + 256 * (a[..., 2] // 16)


def nearest_sources(offset: int, count: int, source: int, resized: int) -> list[set[int]]:
    """For output pixels offset .. offset + count - 1 of a nearest-neighbour resize of ``source`` pixels to
    ``resized``: the source pixel each may take. Its centre maps to (i + 1/2) source / resized, in exact
    arithmetic; on a pixel boundary (a tie) either neighbour is right, elsewhere only the pixel it falls in."""
    from fractions import Fraction

    allowed = []
    for i in range(offset, offset + count):
        pos = Fraction(2 * i + 1, 2) * Fraction(source, resized)
        allowed.append({int(pos), int(pos) - 1} if pos.denominator == 1 else {int(pos)})
    return allowed


@pytest.mark.parametrize(("size", "crop_pct"), CROPS)
def test_nearest_crop_samples_the_right_pixels(size: tuple[int, int], crop_pct: float) -> None:
    """Nearest neighbour, on an image of its own coordinates: every output pixel comes from the source pixel
    that exact arithmetic says (either neighbour where the sample position is exactly on a boundary, which
    the last float bit decides for the full resize and the box alike)."""
    H, W = size
    pre = Preprocess(image_size=size, resize="crop", crop_pct=crop_pct, interpolation="nearest")
    for w, h in [(640, 427), (200, 333), (97, 61), (20, 33), (300, 301), (75, 50)]:
        gx, gy = coordinates(pre.resized(coordinate_image(w, h)))
        new_w, new_h, left, top = crop_geometry(pre, w, h)
        for j, ok in enumerate(nearest_sources(left, W, w, new_w)):
            assert set(gx[:, j].tolist()) <= ok, (w, h, j)
        for i, ok in enumerate(nearest_sources(top, H, h, new_h)):
            assert set(gy[i].tolist()) <= ok, (w, h, i)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos", "nearest"])
def test_crop_is_exact_where_the_sample_positions_are_exact(interpolation: str) -> None:
    """With power-of-two scales and whole-pixel crop offsets every sample position is exact in floating point
    (float32 included), so box resizing and full-resize-then-crop compute the very same sums: equal to the bit."""
    rng = np.random.default_rng(5)
    pre = Preprocess(image_size=(32, 48), resize="crop", crop_pct=1.0, interpolation=interpolation)
    for w, h in [(128, 64), (96, 64), (64, 32), (48, 64), (24, 8), (192, 256), (256, 64)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        np.testing.assert_array_equal(np.asarray(pre.resized(img)), np.asarray(full_resize_then_crop(pre, img)))


def test_elongated_image_is_not_resized_whole(tmp_path: Path) -> None:
    """A 900x1 image under a 224 px centre crop (allowed: 900:1) would be scaled to 230400x256 (177 MB) before
    cropping; resizing only the crop's box needs the 224x224 output. Measured as the growth of the peak resident
    memory of a fresh process (Linux: the peak is reset to the current size first)."""
    import subprocess
    import sys

    from helpers import SRC

    path = tmp_path / "thin.png"
    Image.new("RGB", (900, 1), (10, 200, 30)).save(path)
    script = """
import sys
from PIL import Image
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.images import load_image

def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))

pre = Preprocess(image_size=224, resize="crop", crop_pct=0.875)
img = load_image(sys.argv[1])
pre(Image.new("RGB", (300, 200)))  # everything imported and warm
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak resident size := current
before = kib("VmRSS")
x = pre(img)
print(kib("VmHWM") - before, tuple(x.shape))
"""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}).stdout.split(maxsplit=1)  # fmt: skip
    grown_kib, shape = int(out[0]), out[1].strip()
    assert shape == "(3, 224, 224)"
    assert grown_kib < 30 * 1024, f"peak memory grew by {grown_kib / 1024:.0f} MiB"


@pytest.mark.parametrize(("size", "words"), [((30000, 1), "aspect ratio of 30000:1"), ((1, 5000), "1:5000")])
def test_too_elongated_for_a_centre_crop_is_one_named_error(tmp_path: Path, size: tuple[int, int], words: str) -> None:
    from vitkit.images import ImageTooLarge

    path = tmp_path / "line.png"
    Image.new("L", size, 77).save(path)
    with pytest.raises(ImageTooLarge, match=words) as info:
        Preprocess(image_size=224, resize="crop", crop_pct=0.875)(path)
    assert str(path) in str(info.value)
    assert Preprocess(image_size=224)(path).shape == (3, 224, 224)  # squashing allocates only the output


def test_resized_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image the crop is cut from may not exceed the decoder's pixel limit (Pillow's MAX_IMAGE_PIXELS)."""
    from vitkit.images import ImageTooLarge

    pre = Preprocess(image_size=224, resize="crop", crop_pct=0.875)
    img = Image.new("RGB", (400, 1))  # 400:1, resized to 102400x256 = 26 M pixels before cropping
    assert pre(img).shape == (3, 224, 224)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000_000)
    with pytest.raises(ImageTooLarge, match=r"102400x256 = 26214400 pixels .* limit of 20000000"):
        pre(img)


def test_predict_refuses_a_line_of_pixels_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``vitkit predict`` on a centre-crop checkpoint: a 30000x1 PNG (a few hundred bytes) is one line naming
    the file, exit 2, before any image is classified; a squashing checkpoint classifies it."""
    from helpers import randomize_, run_cli
    from vitkit.checkpoints.vitkit_format import save
    from vitkit.models import create_model

    model = create_model("Ti/16", patch_size=8, image_size=32, hidden_size=32, depth=1, num_heads=2, mlp_dim=64,
                         num_classes=3)  # fmt: skip
    randomize_(model)
    crop = save(model.eval(), tmp_path / "crop", preprocess=Preprocess(image_size=32, resize="crop", crop_pct=0.875))
    squash = save(model.eval(), tmp_path / "squash", preprocess=Preprocess(image_size=32))
    ok, line = tmp_path / "ok.png", tmp_path / "line.png"
    Image.new("RGB", (40, 30), (1, 2, 3)).save(ok)
    Image.new("RGB", (30000, 1), (200, 2, 3)).save(line)
    code, out, err = run_cli(capsys, "predict", "-c", str(crop), str(ok), str(line))
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        f"vitkit predict: error: {line}: image of 30000x1 has an aspect ratio of 30000:1, over the limit of 1000:1 "
        "for a centre crop"
    ]
    code, out, _ = run_cli(capsys, "predict", "-c", str(squash), str(line))
    assert code == 0 and str(line) in out
    # eval on a folder dataset names the file too
    for cls in ("a", "b", "c"):  # the model's three classes
        (tmp_path / "data" / "test" / cls).mkdir(parents=True)
        Image.new("RGB", (40, 30), (1, 2, 3)).save(tmp_path / "data" / "test" / cls / "ok.png")
    (tmp_path / "data" / "test" / "b" / "line.png").write_bytes(line.read_bytes())
    data, out_dir = str(tmp_path / "data"), str(tmp_path / "ev")
    code, _, err = run_cli(capsys, "eval", str(crop), "--data", data, "--out", out_dir)
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith("note:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{tmp_path / 'data' / 'test' / 'b' / 'line.png'}: image of 30000x1 has an aspect ratio" in lines[0]
    code, _, err = run_cli(capsys, "analyze", str(crop), str(ok), str(line), "--out", str(tmp_path / "an"))
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith("note:")]
    assert code == 2 and len(lines) == 1 and "line.png: image of 30000x1 has an aspect ratio" in lines[0], err


# ---- hostile files (issue 32, section 2) --------------------------------------------------------------------


def _segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each top-level segment of a JPEG, a scan's entropy-coded data included."""
    out, i = [], 2
    while i < len(data):
        marker = data[i + 1]
        if marker == 0xD9:
            return [*out, (marker, i, i + 2)]
        j = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        while marker == 0xDA:
            j = data.find(b"\xff", j)
            if data[j + 1] != 0 and not 0xD0 <= data[j + 1] <= 0xD7:
                break
            j += 2
        out.append((marker, i, j))
        i = j
    return out


def scan_bomb(extra: int, size: int = 2000) -> bytes:
    """A progressive JPEG with its last scan repeated ``extra`` times (each one more pass over every
    coefficient for the decoder)."""
    import io

    buf = io.BytesIO()
    Image.new("L", (size, size), 128).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    segs = _segments(data)
    _, start, end = [s for s in segs if s[0] == 0xDA][-1]
    eoi = segs[-1][1]
    return data[:eoi] + data[start:end] * extra + data[eoi:]


def test_a_progressive_jpeg_scan_bomb_is_refused_before_decoding(tmp_path: Path) -> None:
    """300 repeated scans in 20 KB (Pillow decodes them in about a second; 16 MiB holds ~350k): refused from the
    bytes, by both decoders, at once; an ordinary progressive JPEG still decodes."""
    import time

    from vitkit.images import MAX_JPEG_SCANS, decode_image, jpeg_scans, open_lazy

    normal = scan_bomb(0)
    assert 2 <= jpeg_scans(normal) <= 12
    assert decode_image(normal, "ok.jpg").size == (2000, 2000)
    bomb = scan_bomb(300)
    assert jpeg_scans(bomb) == MAX_JPEG_SCANS + 1  # counted up to the bound only
    (tmp_path / "bomb.jpg").write_bytes(bomb)
    for decode in (lambda: decode_image(bomb, "bomb.jpg"), lambda: open_lazy(tmp_path / "bomb.jpg")):
        start = time.perf_counter()
        with pytest.raises(DataError, match=r"bomb\.jpg: a JPEG of more than 64 scans"):
            decode()
        assert time.perf_counter() - start < 0.2


def test_only_the_documented_formats_are_decoded(tmp_path: Path) -> None:
    """A PCX or EPS file (Pillow has plugins for them; EPS runs Ghostscript) named .jpg: not decoded."""
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.jpg", format="PCX")
    (tmp_path / "b.jpg").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n")
    for name in ("a.jpg", "b.jpg"):
        with pytest.raises(DataError, match=rf"{name}: not a recognised image file"):
            load_image(tmp_path / name)


def test_images_that_are_not_regular_files_are_refused_unread(tmp_path: Path) -> None:
    """A link to /dev/zero, a FIFO and a sparse 1.5 GB file: each one line naming it, nothing read (the FIFO
    would block for ever, /dev/zero and the sparse file fill memory)."""
    import multiprocessing
    import os

    from vitkit.images import open_lazy

    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.jpg")
    with (tmp_path / "big.jpg").open("wb") as f:
        f.truncate(1536 << 20)
    ctx = multiprocessing.get_context("fork")
    for name, words in (("zero.jpg", "not a regular file"), ("fifo.jpg", "not a regular file"),
                        ("big.jpg", "more than the 256 MiB")):  # fmt: skip
        for read in (load_image, open_lazy):
            with ctx.Pool(1) as pool:  # in another process: a hang or a memory blow-up fails instead of stalling
                result = pool.apply_async(_error_of, (read, str(tmp_path / name)))
                message = result.get(timeout=30)
            assert message is not None and message.startswith(f"{tmp_path / name}: ") and words in message, message


def _error_of(read: object, path: str) -> str | None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # reading 1.5 GB fails instead of swapping
    try:
        read(path)  # type: ignore[operator]
    except DataError as e:
        return str(e)
    except MemoryError:
        return "MemoryError"
    return None
