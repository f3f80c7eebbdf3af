"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), with a fixed stratified split.

The split is vitkit's own (not ``train_test_split``) so it can never change with a scikit-learn release:
within each class, a fixed permutation puts round(20%) of the images in "test" and the rest in "train"
(1,438 train / 359 test). Pixel values 0..16 are scaled to 0..255.
"""

from __future__ import annotations

import numpy as np

from vitkit.data.datasets import ArrayDataset, MissingSplitError, split_candidates

TEST_FRACTION = 0.2
SPLIT_SEED = 2021  # fixed forever: changing it changes every reported digits number


def digits_split() -> dict[str, np.ndarray]:
    """Indices into ``load_digits()`` for "train" and "test" (each sorted)."""
    from sklearn.datasets import load_digits

    y = load_digits().target
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
    from sklearn.datasets import load_digits

    name = next((s for s in split_candidates(split) if s in ("train", "test")), None)
    if name is None:
        raise MissingSplitError(f"digits: no split {split!r} (available: train, test)")
    data = load_digits()
    idx = digits_split()[name]
    images = np.round(data.images[idx] * (255.0 / 16.0)).astype(np.uint8)  # (N, 8, 8)
    return ArrayDataset("digits", name, images, data.target[idx], [str(c) for c in range(10)])
