"""``--decode gpu`` without a GPU (issue 31, section 2): nvImageCodec faked by a module that decodes with Pillow, the
device arithmetic run on CPU tensors. The resize and crop of a full-scale decode are the reference's pixels within
rounding; the workers hand over checked JPEG bytes (through shared memory) and decode the rest themselves; the
decoder puts a batch together in input order, decoding what nvImageCodec refuses on the CPU, and counts both."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from test_eval_transform import PRES, SIZES, photo

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.eval_transform import EvalTransform, pixels
from vitkit.data.gpu_decode import (
    DecodeRates,
    GpuDecoder,
    GpuDecodeTransform,
    choose_decode,
    measure_rates,
    nvimgcodec_module,
    resize_crop,
)
from vitkit.data.stream import EncodedImage, FileSource, stream_batches
from vitkit.errors import ConfigError, DataError
from vitkit.images import MAX_JPEG_SCANS, load_image, open_lazy

REFUSED = b"nvimgcodec-refuses-this"  # a JPEG comment the fake decoder refuses


def fake_nvimgcodec(log: list[Any] | None = None) -> types.ModuleType:
    """nvImageCodec's interface as vitkit uses it: ``Decoder(device_id, backends).decode(blobs, params,
    cuda_stream)`` -> per blob an (h, w, 3) uint8 array (Pillow's decode) or None (refused)."""
    m = types.ModuleType("nvidia.nvimgcodec")
    m.BackendKind = types.SimpleNamespace(GPU_ONLY="gpu", HYBRID_CPU_GPU="hybrid", CPU_ONLY="cpu")  # type: ignore[attr-defined]
    m.ColorSpec = types.SimpleNamespace(SRGB="srgb")  # type: ignore[attr-defined]
    m.Backend = lambda kind: ("backend", kind)  # type: ignore[attr-defined]
    m.DecodeParams = lambda **kw: kw  # type: ignore[attr-defined]
    calls = log if log is not None else []

    class Decoder:
        def __init__(self, device_id: int = 0, backends: Any = None) -> None:
            calls.append(("Decoder", device_id, backends))

        def decode(self, blobs: list[np.ndarray], params: Any = None, cuda_stream: int = 0) -> list[Any]:
            calls.append(("decode", len(blobs), params))
            out = []
            for b in blobs:
                data = bytes(b)
                out.append(None if REFUSED in data else np.array(Image.open(io.BytesIO(data)).convert("RGB")))
            return out

    m.Decoder = Decoder  # type: ignore[attr-defined]
    return m


def err_levels(got: torch.Tensor, want: torch.Tensor) -> np.ndarray:
    return np.abs(got.double().numpy() - want.double().numpy())


@pytest.mark.parametrize("pre", PRES)
@pytest.mark.parametrize("size", SIZES)
def test_device_resize_of_the_full_decode_is_the_reference_within_rounding(
    tmp_path: Path, pre: Preprocess, size: tuple[int, int]
) -> None:
    """What the GPU computes after nvJPEG's full-scale decode, here on the CPU: Pillow's resize and crop of the
    whole image (the reference) within rounding: every value within 1 level, fewer than 1% of them off (measured
    at most 0.3%) -- closer than the workers' own full-scale path is held to (max 2, mean < 0.05) and far inside
    their reduced-scale bound (mean < 1, test_eval_transform.py)."""
    path = photo(tmp_path / "p.jpg", *size)
    full = load_image(path)
    x = torch.from_numpy(np.asarray(full).copy()).permute(2, 0, 1)[None]  # (1, 3, h, w) uint8
    got = resize_crop(x, pre)[0]
    want = pixels(pre, full)
    assert got.shape == want.shape and got.dtype == torch.uint8
    err = err_levels(got, want)
    assert err.max() <= 1 and err.mean() < 0.01


def test_images_of_one_size_are_resized_as_one_batch(tmp_path: Path) -> None:
    pre = PRES[1]
    a, b = (load_image(photo(tmp_path / f"{n}.jpg", 500, 375)) for n in "ab")
    x = torch.stack([torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1) for img in (a, b)])
    x[1] = x[1].flip(-1)
    both = resize_crop(x, pre)
    assert torch.equal(both[0], resize_crop(x[:1], pre)[0]) and torch.equal(both[1], resize_crop(x[1:], pre)[0])


def jpeg(path: Path, size: tuple[int, int], seed: int = 0, **save: Any) -> str:
    rng = np.random.default_rng(seed)
    smooth = rng.integers(0, 256, (size[1] // 8 + 1, size[0] // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(smooth).resize(size, Image.Resampling.BILINEAR)
    img.save(path, quality=92, **save)
    return str(path)


def test_workers_hand_over_checked_jpegs_undecoded_and_decode_the_rest(tmp_path: Path) -> None:
    pre = Preprocess(image_size=16)
    cpu = EvalTransform(pre, uint8=True)
    t = GpuDecodeTransform(cpu)
    assert t.lazy
    photo_jpg = jpeg(tmp_path / "a.jpg", (64, 48))
    got = t(open_lazy(photo_jpg), photo_jpg)
    assert isinstance(got, EncodedImage) and (got.width, got.height, got.name) == (64, 48, photo_jpg)
    assert got.data == Path(photo_jpg).read_bytes()
    png, grey = tmp_path / "b.png", tmp_path / "c.jpg"
    Image.open(photo_jpg).save(png)
    Image.open(photo_jpg).convert("L").save(grey)
    line = jpeg(tmp_path / "line.jpg", (900, 2))  # a line of pixels: the CPU resizes only its crop's box
    crop = Preprocess(image_size=16, resize="crop", crop_pct=0.875)
    for path, p in ((png, pre), (grey, pre), (line, crop)):
        x = GpuDecodeTransform(EvalTransform(p, uint8=True))(open_lazy(path), str(path))
        assert isinstance(x, torch.Tensor) and torch.equal(x, EvalTransform(p, uint8=True)(open_lazy(path), str(path)))
    wide = jpeg(tmp_path / "wide.jpg", (3200, 2))  # over 1000:1 -- refused from the header, never sent
    with pytest.raises(DataError, match="aspect ratio"):
        GpuDecodeTransform(EvalTransform(crop, uint8=True))(open_lazy(wide), wide)


def test_the_readers_checks_apply_before_any_byte_reaches_the_decoder(tmp_path: Path) -> None:
    """The bytes sent to the GPU come from open_lazy: a FIFO, a JPEG of too many scans are refused there."""
    good = Path(jpeg(tmp_path / "a.jpg", (64, 48)))
    data = good.read_bytes()
    scans = data[:-2] + b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" * (MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(scans)
    with pytest.raises(DataError, match="scans"):
        open_lazy(bomb)
    import os

    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        open_lazy(fifo)


def mixed_folder(tmp_path: Path) -> list[str]:
    files = [jpeg(tmp_path / f"{i}.jpg", (64 + 8 * (i % 2), 48), seed=i) for i in range(5)]
    png = tmp_path / "5.png"
    Image.open(files[0]).save(png)
    refused = jpeg(tmp_path / "6.jpg", (64, 48), seed=6, comment=REFUSED)
    return [*files[:2], str(png), *files[2:4], refused, files[4]]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_decoder_puts_a_batch_together_in_order_and_falls_back_to_the_cpu(tmp_path: Path, workers: int) -> None:
    pre = Preprocess(image_size=16)
    files = mixed_folder(tmp_path)
    cpu = EvalTransform(pre, uint8=True)
    log: list[Any] = []
    decoder = GpuDecoder(pre, fake_nvimgcodec(log), torch.device("cpu"))
    assert log[0] == ("Decoder", 0, [("backend", "gpu"), ("backend", "hybrid")])  # never the CPU-only decoders
    batches = list(stream_batches(FileSource(files), GpuDecodeTransform(cpu), 4, workers=workers))
    assert [len(b) for b in batches] == [4, 3]
    first = batches[0]
    assert first.encoded is not None and first.encoded.rows.tolist() == [0, 1, 3] and len(first.images) == 1
    if workers:
        assert first.encoded.data.is_shared()  # one transfer through shared memory, not a pickle per image
    got = torch.cat([decoder.images(b)[0] for b in batches])
    assert [c[0] for c in log].count("decode") == 2  # one batched call per batch
    assert log[1][2] == {"color_spec": "srgb", "apply_exif_orientation": False}  # as Pillow: EXIF ignored
    want = torch.stack([pixels(pre, load_image(f)) for f in files])
    for i, f in enumerate(files):
        if f.endswith(".png") or i == 5:  # the workers' pixels / nvImageCodec refused: the CPU path, exactly
            assert torch.equal(got[i], cpu(open_lazy(f), f)), f
        else:
            assert err_levels(got[i], want[i]).max() <= 2, f
    c = decoder.counts
    assert (c.gpu, c.workers, c.refused, c.first_refused) == (5, 1, 1, files[5])
    assert c.note() == (
        "--decode gpu: 5 of 7 image(s) decoded on the GPU; on the CPU: 1 not GPU-decodable (not colour JPEGs, or "
        f"too large), 1 refused by nvImageCodec (first: {files[5]})"
    )


def test_a_jpeg_neither_decoder_reads_is_the_cpu_decoders_one_line_error(tmp_path: Path) -> None:
    pre = Preprocess(image_size=16)
    good = Path(jpeg(tmp_path / "a.jpg", (64, 48)))
    data = good.read_bytes()
    broken = tmp_path / "broken.jpg"  # a header that reads, a refusal marker, then no image data
    broken.write_bytes(data[:2] + b"\xff\xfe\x00\x19" + REFUSED + data[2:200])
    batches = stream_batches(FileSource([str(broken)]), GpuDecodeTransform(EvalTransform(pre, uint8=True)), 2)
    decoder = GpuDecoder(pre, fake_nvimgcodec(), torch.device("cpu"))
    with pytest.raises(DataError) as e:
        decoder.images(next(batches))
    assert str(e.value).startswith(f"{broken}: ") and "\n" not in str(e.value)


# ---- choosing ---------------------------------------------------------------------------------------------


def test_choose_decode_follows_the_option_the_device_and_the_measurement() -> None:
    fake = fake_nvimgcodec()
    asked: list[str] = []

    def rates(cpu: float, gpu: float) -> Any:
        return lambda: (asked.append("measured"), DecodeRates(cpu=cpu, gpu=gpu))[1]

    assert not choose_decode("cpu", True, module=lambda: fake, rates=rates(1, 2))
    assert choose_decode("gpu", True, module=lambda: fake) and not asked
    assert not choose_decode("auto", False, module=lambda: fake, rates=rates(1, 2)) and not asked  # not on CUDA
    assert not choose_decode("auto", True, module=lambda: None, rates=rates(1, 2)) and not asked  # not installed
    assert choose_decode("auto", True, module=lambda: fake, rates=rates(1000, 3000)) and asked == ["measured"]
    assert not choose_decode("auto", True, module=lambda: fake, rates=rates(3000, 1000))
    assert not choose_decode("auto", True, module=lambda: fake, rates=lambda: None)  # no JPEG to measure on
    with pytest.raises(ConfigError, match=r"^--decode gpu: the model must run on a CUDA device"):
        choose_decode("gpu", False, module=lambda: fake)
    with pytest.raises(ConfigError, match=r"^--decode gpu: nvImageCodec is not installed.*vitkit\[gpu\]"):
        choose_decode("gpu", True, module=lambda: None)


def test_measure_rates_times_both_decoders_on_the_jobs_own_jpegs(tmp_path: Path) -> None:
    pre = Preprocess(image_size=16)
    files = mixed_folder(tmp_path)
    log: list[Any] = []
    decoder = GpuDecoder(pre, fake_nvimgcodec(log), torch.device("cpu"))
    r = measure_rates(FileSource(files), range(len(files)), EvalTransform(pre, uint8=True), decoder, workers=3)
    assert r is not None and r.cpu > 0 and r.gpu > 0
    assert [c[1] for c in log if c[0] == "decode"] == [6, 6]  # the 6 JPEGs, untimed once, then timed
    assert decoder.counts.gpu == 0  # the sample is not counted as the job's
    png_only = [f for f in files if f.endswith(".png")]
    assert measure_rates(FileSource(png_only), [0], EvalTransform(pre, uint8=True), decoder, 1) is None


def test_nvimgcodec_is_imported_only_when_asked_and_absent_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia", None)  # not installed (None in sys.modules: ImportError)
    assert nvimgcodec_module() is None
    nvidia = types.ModuleType("nvidia")
    fake = fake_nvimgcodec()
    nvidia.nvimgcodec = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    assert nvimgcodec_module() is fake
