"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), with a fixed stratified split.

The split is vitkit's own (not ``train_test_split``) so it can never change with a scikit-learn release:
within each class, a fixed permutation puts round(20%) of the images in "test" and the rest in "train"
(1,438 train / 359 test). Pixel values 0..16 are scaled to 0..255.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from vitkit.data.image_dataset import ArrayDataset, MissingSplitError, split_candidates
from vitkit.errors import DataError

TEST_FRACTION = 0.2
SPLIT_SEED = 2021  # fixed forever: changing it changes every reported digits number


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float 0..16, labels (1797,)): the same arrays as ``sklearn.datasets.load_digits``,
    read straight from the file scikit-learn ships, without importing scikit-learn (2-3 s of start-up)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DataError("digits: scikit-learn is not installed (it ships the 8x8 digits)")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")  # (1797, 65): 64 pixels, then the label
    except OSError as e:
        raise DataError(f"{path}: cannot read scikit-learn's digits ({e})") from None
    return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)


def digits_split() -> dict[str, np.ndarray]:
    """Indices into the digits arrays for "train" and "test" (each sorted)."""
    _, y = load_digits_arrays()
    rng = np.random.default_rng(SPLIT_SEED)
    train, test = [], []
    for c in range(10):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(idx.size)]
        n_test = round(TEST_FRACTION * idx.size)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return {"train": np.sort(np.concatenate(train)), "test": np.sort(np.concatenate(test))}


def open_digits(split: str = "train") -> ArrayDataset:
    """The digits as 8x8 images (shown as RGB by the dataset interface); splits "train" and "test"."""
    name = next((s for s in split_candidates(split) if s in ("train", "test")), None)
    if name is None:
        raise MissingSplitError(f"digits: no split {split!r} (available: train, test)")
    pixels, labels = load_digits_arrays()
    idx = digits_split()[name]
    images = np.round(pixels[idx] * (255.0 / 16.0)).astype(np.uint8)  # (N, 8, 8)
    return ArrayDataset("digits", name, images, labels[idx], [str(c) for c in range(10)])
