"""open_dataset over every source kind, and bad data named, skipped and counted (never shifted)."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitkit.data.datasets import open_dataset, open_split_or_none
from vitkit.data.digits import digits_split, load_digits_arrays
from vitkit.errors import DataError


def _png(path: Path, value: int, size: tuple[int, int] = (12, 10), mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode in ("L", "P") else (value, 255 - value, 7)).save(path)


def make_folder(root: Path, classes: dict[str, int]) -> None:
    for i, (cls, n) in enumerate(classes.items()):
        for j in range(n):
            _png(root / cls / f"{j}.png", 20 * i + j)


# ---- digits ---------------------------------------------------------------------------------------


def test_digits_are_scikit_learns_arrays() -> None:
    from sklearn.datasets import load_digits

    ref = load_digits()
    images, labels = load_digits_arrays()
    assert np.array_equal(images, ref.images) and np.array_equal(labels, ref.target)


def test_digits_fixed_stratified_split() -> None:
    from sklearn.datasets import load_digits

    y = load_digits().target
    split = digits_split()
    train, test = split["train"], split["test"]
    assert len(train) == 1438 and len(test) == 359 and not set(train) & set(test)
    # stratified: every class holds 20% (rounded) of its images in test
    for c in range(10):
        assert (y[test] == c).sum() == round(0.2 * (y == c).sum())
    ds = open_dataset("digits", "test")
    img, label = ds[5]
    assert img.mode == "RGB" and img.size == (8, 8) and label == y[test[5]]
    assert ds.classes == [str(i) for i in range(10)]
    assert open_split_or_none("digits", "val") is None  # no such split: the trainer falls back to test


# ---- ImageFolder ----------------------------------------------------------------------------------


def test_image_folder_layouts_and_class_map(tmp_path: Path) -> None:
    make_folder(tmp_path / "flat", {"cat": 2, "dog": 3})
    ds = open_dataset(tmp_path / "flat")
    assert ds.classes == ["cat", "dog"] and len(ds) == 5 and list(ds.labels) == [0, 0, 1, 1, 1]
    img, label = ds[3]
    assert img.mode == "RGB" and label == 1
    # split folders; the val split lacks "bird" but indices follow train's class map
    make_folder(tmp_path / "split" / "train", {"bird": 1, "cat": 1, "dog": 1})
    make_folder(tmp_path / "split" / "validation", {"cat": 1, "dog": 2})
    val = open_dataset(tmp_path / "split", "val")
    assert val.classes == ["bird", "cat", "dog"] and list(val.labels) == [1, 2, 2]
    (tmp_path / "split" / "validation" / "cow").mkdir()
    _png(tmp_path / "split" / "validation" / "cow" / "a.png", 3)
    with pytest.raises(DataError, match="'cow' is not among"):
        open_dataset(tmp_path / "split", "val")
    assert open_split_or_none(tmp_path / "split", "test") is None


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "I;16", "1"])
def test_any_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "c" / ("x.tiff" if mode in ("CMYK", "I;16") else "x.png")
    path.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (9, 7, 3), dtype=np.uint8)).convert(mode).save(path)
    img, _ = open_dataset(tmp_path)[0]
    assert img.mode == "RGB" and img.size == (7, 9)


def test_bad_images_are_named_or_skipped_and_counted(tmp_path: Path, sample_jpeg: Path) -> None:
    make_folder(tmp_path, {"a": 2, "b": 2, "c": 2})
    (tmp_path / "a" / "zero.png").touch()
    with pytest.raises(DataError, match=r"zero\.png: empty file"):
        open_dataset(tmp_path)
    (tmp_path / "a" / "zero.png").unlink()
    trunc = tmp_path / "b" / "trunc.jpg"
    trunc.write_bytes(sample_jpeg.read_bytes()[:3000])
    (tmp_path / "b" / "notes.txt").write_text("ignored: not an image extension")
    ds = open_dataset(tmp_path)  # listing is cheap; decoding finds the bad file and names it
    i = ds.paths.index(str(trunc))  # type: ignore[attr-defined]
    with pytest.raises(DataError, match=r"trunc\.jpg: corrupt or truncated"):
        ds[i]
    (tmp_path / "a" / "zero.png").touch()
    (tmp_path / "b" / "garbage.png").write_bytes(b"definitely not a png")
    ds = open_dataset(tmp_path, skip_bad=True)
    assert len(ds) == 6 and ds.classes == ["a", "b", "c"]
    assert sorted(Path(s.item).name for s in ds.skipped) == ["garbage.png", "trunc.jpg", "zero.png"]
    assert list(ds.labels) == [0, 0, 1, 1, 2, 2]


def test_empty_class_folder_is_an_error_or_keeps_its_index(tmp_path: Path) -> None:
    make_folder(tmp_path, {"a": 1, "c": 1})
    (tmp_path / "b").mkdir()
    with pytest.raises(DataError, match=f"{tmp_path / 'b'}: empty class folder"):
        open_dataset(tmp_path)
    ds = open_dataset(tmp_path, skip_bad=True)
    assert ds.classes == ["a", "b", "c"] and list(ds.labels) == [0, 2]  # "c" stays 2: no silent shift
    assert [s.reason for s in ds.skipped] == ["empty class folder"]


# ---- npz ------------------------------------------------------------------------------------------


def test_npz_splits_and_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    x = rng.integers(0, 255, (6, 5, 4), dtype=np.uint8)
    np.savez(path, x_train=x, y_train=np.arange(6) % 3, x_test=x[:2].astype(np.float32) / 255, y_test=[0, 2])
    tr, te = open_dataset(path), open_dataset(path, "test")
    assert len(tr) == 6 and tr.classes == ["0", "1", "2"] and te.classes == tr.classes
    img, label = te[1]
    assert img.size == (4, 5) and label == 2
    np.testing.assert_array_equal(np.asarray(img)[..., 0], x[1])
    assert open_split_or_none(path, "val") is None
    bad = tmp_path / "bad.npz"
    np.savez(bad, images=x, labels=np.arange(5))
    with pytest.raises(DataError, match=r"bad\.npz: 6 images in 'images' but 5 labels in 'labels'"):
        open_dataset(bad)
    np.savez(bad, images=x, labels=np.arange(6), classes=np.asarray(["a", "b"]))
    with pytest.raises(DataError, match=r"bad\.npz: label 5 in 'labels' but only 2 names"):
        open_dataset(bad)
    obj = tmp_path / "obj.npz"
    np.savez(obj, images=np.empty(2, dtype=object), labels=[0, 1])
    with pytest.raises(DataError, match=r"obj\.npz"):
        open_dataset(obj)


# ---- CIFAR ----------------------------------------------------------------------------------------


def _cifar_pickle(path: Path, obj: object) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def make_cifar10(root: Path, per_batch: int = 3) -> np.ndarray:
    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    _cifar_pickle(root / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    data = rng.integers(0, 255, (6 * per_batch, 3072), dtype=np.uint8)
    for i in range(6):
        rows = data[i * per_batch : (i + 1) * per_batch]
        name = f"data_batch_{i + 1}" if i < 5 else "test_batch"
        _cifar_pickle(root / name, {b"data": rows, b"labels": [(i + j) % 10 for j in range(per_batch)]})
    return data


def test_cifar10_and_100(tmp_path: Path) -> None:
    data = make_cifar10(tmp_path / "cifar-10-batches-py")
    tr = open_dataset(tmp_path)  # the parent folder of the release is found too
    te = open_dataset(tmp_path / "cifar-10-batches-py", "test")
    assert len(tr) == 15 and len(te) == 3 and tr.classes[3] == "c3"
    img, label = te[1]
    assert img.size == (32, 32) and label == 6
    # channel-major rows: the first 1024 bytes are the red plane
    np.testing.assert_array_equal(np.asarray(img)[..., 0].ravel(), data[16, :1024])
    c100 = tmp_path / "cifar-100-python"
    c100.mkdir()
    _cifar_pickle(c100 / "meta", {"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": []})
    for split, n in (("train", 4), ("test", 2)):
        _cifar_pickle(c100 / split, {"data": data[:n], "fine_labels": [99] * n, "coarse_labels": [0] * n})
    ds = open_dataset(c100, "test")
    assert len(ds) == 2 and ds.num_classes == 100 and ds[0][1] == 99


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_cifar_wrong_pickles_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    make_cifar10(root)
    _cifar_pickle(root / "data_batch_3", {b"data": _Evil(), b"labels": [0]})
    with pytest.raises(DataError, match=r"data_batch_3: not a CIFAR python-pickle file \(refusing to load"):
        open_dataset(root)
    _cifar_pickle(root / "data_batch_3", {b"labels": [0]})
    with pytest.raises(DataError, match=r"data_batch_3: a CIFAR batch needs 'data'"):
        open_dataset(root)
    _cifar_pickle(root / "data_batch_3", {b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1]})
    with pytest.raises(DataError, match=r"data_batch_3: 3 images but 2 labels"):
        open_dataset(root)
    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": 1}, protocol=2)[:10])
    with pytest.raises(DataError, match=r"data_batch_3: corrupt or truncated"):
        open_dataset(root)


# ---- WebDataset -----------------------------------------------------------------------------------


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _png_bytes(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (6, 4), value).save(buf, format="PNG")
    return buf.getvalue()


def make_shards(root: Path, split: str, n_shards: int, per_shard: int) -> list[int]:
    root.mkdir(parents=True, exist_ok=True)
    labels = []
    for s in range(n_shards):
        with tarfile.open(root / f"{split}-{s:04d}.tar", "w") as tf:
            for j in range(per_shard):
                k = s * per_shard + j
                _add(tf, f"sample{k:05d}.png", _png_bytes(k))
                _add(tf, f"sample{k:05d}.cls", str(k % 3).encode())
                labels.append(k % 3)
    return labels


def test_webdataset_shards(tmp_path: Path) -> None:
    labels = make_shards(tmp_path, "train", 3, 4)
    make_shards(tmp_path, "val", 1, 2)
    (tmp_path / "classes.txt").write_text("zero\none\ntwo\n")
    ds = open_dataset(tmp_path, "train")
    assert len(ds) == 12 and list(ds.labels) == labels and ds.classes == ["zero", "one", "two"]
    img, label = ds[7]
    assert img.mode == "RGB" and img.size == (6, 4) and np.asarray(img)[0, 0, 0] == 7 and label == 1
    assert [lab for _, lab in ds] == labels
    pattern = str(tmp_path / "train-{0000..0001}.tar")
    assert len(open_dataset(pattern)) == 8
    assert len(open_dataset(tmp_path, "validation")) == 2
    assert open_split_or_none(tmp_path, "test") is None


def test_webdataset_bad_samples(tmp_path: Path) -> None:
    shard = tmp_path / "bad.tar"
    with tarfile.open(shard, "w") as tf:
        _add(tf, "a.png", _png_bytes(1))
        _add(tf, "a.cls", b"0")
        _add(tf, "b.png", _png_bytes(2))  # no label
        _add(tf, "c.png", b"garbage")
        _add(tf, "c.cls", b"1")
    with pytest.raises(DataError, match=r"bad\.tar: sample 'b' has no label member"):
        open_dataset(shard)
    ds = open_dataset(shard, skip_bad=True)  # skip_bad decodes every image once: the garbage one is dropped too
    assert len(ds) == 1 and [s.reason for s in ds.skipped] == [
        "sample 'b' has no label member (.cls)",
        "not a recognised image file",
    ]
    assert ds.skipped[1].item.endswith("bad.tar:c.png")
    whole = tmp_path / "whole.tar"
    with tarfile.open(whole, "w") as tf:
        _add(tf, "a.png", _png_bytes(1))
        _add(tf, "a.cls", b"0")
        _add(tf, "c.png", b"garbage")
        _add(tf, "c.cls", b"1")
    with pytest.raises(DataError, match=r"whole\.tar:c\.png: not a recognised image"):
        open_dataset(whole)[1]  # without skip_bad: found when decoded
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shard.read_bytes()[:1500])
    with pytest.raises(DataError, match=r"cut\.tar: corrupt or truncated tar shard"):
        open_dataset(cut)


def test_a_huge_label_is_one_line_not_an_allocation(tmp_path: Path) -> None:
    """A one-sample shard labelled 3000000000 (3e9 class names and a head that size), or a label member of
    100 MB: each refused while the shards are indexed, naming the sample; an .npz of such labels likewise."""
    huge = tmp_path / "huge"
    huge.mkdir()
    with tarfile.open(huge / "train-0000.tar", "w") as tf:
        _add(tf, "a.png", _png_bytes(1))
        _add(tf, "a.cls", b"3000000000")
    with pytest.raises(DataError, match=r"train-0000\.tar: sample 'a': label 3000000000 is above 9999999"):
        open_dataset(huge, "train")
    big = tmp_path / "big"
    big.mkdir()
    with tarfile.open(big / "train-0000.tar", "w") as tf:
        _add(tf, "a.png", _png_bytes(1))
        _add(tf, "a.cls", b"1" + b" " * (100 << 20))
    with pytest.raises(DataError, match=r"sample 'a': a label member of 104857601 bytes"):
        open_dataset(big, "train")
    np.savez(tmp_path / "d.npz", x_train=np.zeros((1, 4, 4), np.uint8), y_train=np.array([2_000_000_000]))
    with pytest.raises(DataError, match=r"label 2000000000 is above 9999999"):
        open_dataset(tmp_path / "d.npz", "train")


def test_unknown_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope: no such file"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(DataError, match=r"x\.csv: unsupported dataset file"):
        open_dataset(tmp_path / "x.csv")
