"""One image decoder for every command (issue 13, items 4 and 6): decompression bombs are bad input like any
other, 16-bit greyscale is rescaled the same way everywhere, broken symbolic links are reported, and
``skip_bad`` counts what it drops."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset
from vitkit.data.image_dataset import skipped_note
from vitkit.data.loader import eval_batches
from vitkit.data.transforms import TrainTransform
from vitkit.errors import DataError
from vitkit.images import ImageTooLarge, convert_image, decode_image, load_image


def bomb_png(width: int, height: int) -> bytes:
    """A 100-byte PNG whose header declares ``width`` x ``height`` 8-bit grey pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _png(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(path)


def _folder_with_bomb(root: Path) -> Path:
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            _png(root / cls / f"{i}.png", i)
    bomb = root / "a" / "bomb.png"
    bomb.write_bytes(bomb_png(30000, 30000))
    return bomb


@pytest.mark.parametrize("size", [(30000, 30000), (20000, 10000)])  # above Pillow's error and warning limits
def test_a_decompression_bomb_is_one_data_error_naming_the_file(tmp_path: Path, size: tuple[int, int]) -> None:
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb_png(*size))
    with pytest.raises(ImageTooLarge, match=rf"^{path}: .*{size[0] * size[1]} pixels"):
        load_image(path)
    with pytest.raises(DataError, match=r"^shard\.tar:x\.png: "):
        decode_image(path.read_bytes(), "shard.tar:x.png")
    small = io.BytesIO()
    Image.new("RGB", (20, 10)).save(small, "PNG")
    assert decode_image(small.getvalue(), "x", max_pixels=200).size == (20, 10)
    with pytest.raises(ImageTooLarge, match=r"^x: image of 20x10 = 200 pixels exceeds the limit of 199 pixels"):
        decode_image(small.getvalue(), "x", max_pixels=199)  # a caller's own limit (vitkit serve's)


def test_skip_bad_counts_a_bomb_in_a_folder_and_says_so(tmp_path: Path) -> None:
    bomb = _folder_with_bomb(tmp_path / "ds")
    ds = open_dataset(tmp_path / "ds")
    index = ds.paths.index(str(bomb))  # type: ignore[attr-defined]
    with pytest.raises(DataError, match=f"^{bomb}: "):
        ds[index]
    ds = open_dataset(tmp_path / "ds", skip_bad=True)
    assert len(ds) == 6 and [s.item for s in ds.skipped] == [str(bomb)]
    note = skipped_note(ds)
    assert note is not None and note.startswith(f"{tmp_path / 'ds'} [train]: skipped 1 bad item(s), kept 6")
    assert str(bomb) in note and "900000000 pixels" in note
    assert skipped_note(open_dataset(tmp_path / "ds", "train", skip_bad=True, classes=["a", "b"])) == note


def test_a_bomb_met_by_loader_workers_is_the_files_one_line_error(tmp_path: Path) -> None:
    """Worker processes return the DataError as a message; the parent raises it naming the file."""
    bomb = _folder_with_bomb(tmp_path / "ds")
    ds = open_dataset(tmp_path / "ds")
    pre = Preprocess(image_size=(8, 8))
    with pytest.raises(DataError, match=f"^{bomb}: "):
        list(eval_batches(ds, pre.to_tensor, batch_size=4, workers=2))


def test_skip_bad_decodes_shards_and_drops_a_bomb(tmp_path: Path) -> None:
    shard = tmp_path / "train-0.tar"
    members = [("0.png", 0), ("1.png", 1), ("2.png", 0)]
    with tarfile.open(shard, "w") as tf:
        for name, label in members:
            buf = io.BytesIO()
            Image.new("RGB", (6, 5), (10 * label, 20, 30)).save(buf, "PNG")
            data = bomb_png(30000, 30000) if name == "1.png" else buf.getvalue()
            for member, payload in ((name, data), (name.replace(".png", ".cls"), str(label).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    plain = open_dataset(shard)
    with pytest.raises(DataError, match=r"train-0\.tar:1\.png: .*pixels"):
        plain[1]
    ds = open_dataset(shard, skip_bad=True)
    assert len(ds) == 2 and len(ds.skipped) == 1 and ds.skipped[0].item.endswith("train-0.tar:1.png")
    assert [int(label) for label in ds.labels] == [0, 0]
    assert ds[1][0].size == (6, 5)


def test_16_bit_greyscale_is_rescaled_alike_for_training_and_prediction(tmp_path: Path) -> None:
    """predict/eval (Preprocess) and training (datasets, TrainTransform) share one conversion: 65535 -> 255,
    not Pillow's clipping, which turned 99.5% of a 16-bit image white."""
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    path = tmp_path / "cls" / "g16.png"
    path.parent.mkdir()
    Image.fromarray(ramp).save(path)
    img = load_image(path)
    assert img.mode.startswith("I;16")
    expected = np.clip(ramp / 65535.0 * 255.0 + 0.5, 0, 255).astype(np.uint8)
    assert np.array_equal(np.asarray(convert_image(img, "L")), expected)
    for gray in (True, False):
        pre = Preprocess(image_size=(64, 64), mean=(0.0,) * 3, std=(1.0,) * 3, grayscale=gray)
        x_predict = pre(path)  # vitkit predict / analyze: file -> tensor
        assert torch.allclose(x_predict[0], torch.from_numpy(expected / 255.0).float())
        x_dataset = pre.to_tensor(open_dataset(tmp_path)[0][0])  # eval / fewshot: dataset item -> tensor
        assert torch.equal(x_predict, x_dataset)
        train = TrainTransform((64, 64), "resize", flip=False, mean=(0.0,) * 3, std=(1.0,) * 3, grayscale=gray)
        x_train = train(img, np.random.default_rng(0))  # training: augmentation on the decoded image
        assert torch.equal(x_predict, x_train)
    assert (np.asarray(convert_image(img, "L")) == 255).mean() < 0.01


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_dangling_and_looping_symlinks_are_reported_not_dropped(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            _png(root / cls / f"{i}.png", i)
    dangling = root / "a" / "gone.png"
    os.symlink(tmp_path / "nowhere.png", dangling)
    loop = root / "b" / "loop.jpg"
    os.symlink(root / "b" / "loop.jpg", loop)
    (root / "a" / "ok.png").symlink_to(root / "a" / "0.png")  # a working link is an image like any other
    with pytest.raises(DataError, match=rf"^{dangling}: dangling symbolic link"):
        open_dataset(root)
    ds = open_dataset(root, skip_bad=True)
    assert len(ds) == 5
    reasons = {s.item: s.reason for s in ds.skipped}
    assert reasons[str(dangling)].startswith("dangling symbolic link")
    assert reasons[str(loop)].startswith("symbolic link loop")
    dangling.unlink()
    with pytest.raises(DataError, match=rf"^{loop}: symbolic link loop"):
        open_dataset(root)
