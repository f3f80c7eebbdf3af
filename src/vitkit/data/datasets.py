"""Datasets: one interface over the bundled digits, ImageFolder trees, CIFAR, ``.npz`` arrays and WebDataset shards.

``open_dataset(source, split)`` is the single entry point every part of vitkit uses::

    ds = open_dataset("digits", "train")          # scikit-learn's 8x8 digits, fixed stratified split
    ds = open_dataset("path/to/imagenet", "val")  # ImageFolder: <root>/<split>/<class>/<image>
    ds = open_dataset("path/to/cifar-10-batches-py", "test")
    ds = open_dataset("arrays.npz", "train")      # images + labels arrays
    ds = open_dataset("shards/", "train")         # WebDataset tar shards: <root>/<split>-*.tar

An :class:`ImageDataset` has ``classes`` (index -> name), ``len(ds)``, ``ds[i] -> (PIL RGB image, label)``
and iterates as (image, label) pairs. ``ds.labels`` gives every label without decoding images.

Bad data is never silently absorbed: a corrupt, truncated or zero-byte image, an empty class folder or a
label array that does not match raises :class:`~vitkit.errors.DataError` naming the file. With
``skip_bad=True`` such items are dropped instead and listed in ``ds.skipped`` (class indices never shift:
an empty class folder keeps its index).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vitkit.data.preprocess import convert_image
from vitkit.errors import DataError

# Split names that mean "held-out data", tried in this order when a source has no split of the exact name.
SPLIT_ALIASES: dict[str, tuple[str, ...]] = {
    "train": ("train", "training"),
    "val": ("val", "validation", "valid"),
    "validation": ("validation", "val", "valid"),
    "test": ("test", "testing"),
}


def split_candidates(split: str) -> tuple[str, ...]:
    """Folder/key names a split may go by (``"val"`` -> val, validation, valid)."""
    return SPLIT_ALIASES.get(split, (split,))


class MissingSplitError(DataError):
    """The source exists but has no split of the requested name."""


@dataclass(frozen=True)
class Skipped:
    """One item dropped because of ``skip_bad=True``: where it is and why."""

    item: str
    reason: str


class ImageDataset:
    """A labelled image dataset (map-style): ``ds[i] -> (PIL RGB image, int label)``.

    Subclasses set ``classes``, ``labels`` (int64 array, one per item) and implement ``load_image(i)``.
    """

    classes: list[str]
    labels: np.ndarray  # (N,) int64
    source: str
    split: str
    skipped: list[Skipped]

    def __init__(self, source: str, split: str, classes: list[str], labels: np.ndarray) -> None:
        self.source, self.split = source, split
        self.classes = list(classes)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.skipped = []
        if self.labels.size and (self.labels.min() < 0 or self.labels.max() >= len(self.classes)):
            bad = int(self.labels[(self.labels < 0) | (self.labels >= len(self.classes))][0])
            raise DataError(f"{source}: label {bad} is outside the {len(self.classes)} classes")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} items")
        index = index % n
        return to_rgb(self.load_image(index)), int(self.labels[index])

    def __iter__(self) -> Iterator[tuple[Image.Image, int]]:
        for i in range(len(self)):
            yield self[i]

    def load_image(self, index: int) -> Image.Image:
        """Decode item ``index`` (any mode; ``__getitem__`` converts to RGB). Raises DataError naming it."""
        raise NotImplementedError

    def describe(self, index: int) -> str:
        """A human-readable name of item ``index`` (its file, or source[index]) for error messages."""
        return f"{self.source}[{index}]"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __repr__(self) -> str:
        extra = f", skipped={len(self.skipped)}" if self.skipped else ""
        return (
            f"{type(self).__name__}(source={self.source!r}, split={self.split!r}, items={len(self)}, "
            f"classes={len(self.classes)}{extra})"
        )


class ArrayDataset(ImageDataset):
    """Images held in one uint8 array (N, H, W) or (N, H, W, C), C in {1, 3, 4}."""

    def __init__(self, source: str, split: str, images: np.ndarray, labels: np.ndarray, classes: list[str]) -> None:
        super().__init__(source, split, classes, labels)
        if images.shape[0] != self.labels.shape[0]:
            raise DataError(f"{source}: {images.shape[0]} images but {self.labels.shape[0]} labels ({split})")
        self.images = images

    def load_image(self, index: int) -> Image.Image:
        arr = self.images[index]
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        return Image.fromarray(np.ascontiguousarray(arr))


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB (16-bit and float greyscale are rescaled to 8 bits first): the conversion of
    every command, :func:`vitkit.data.preprocess.convert_image`."""
    return convert_image(img, "RGB")


def skipped_note(ds: ImageDataset) -> str | None:
    """The one-line account of what ``skip_bad`` dropped from ``ds`` (None when nothing was), for the console:
    how many items, and the first one with its reason."""
    if not ds.skipped:
        return None
    first = ds.skipped[0]
    more = f" (first: {first.item}: {first.reason})"
    return f"{ds.source} [{ds.split}]: skipped {len(ds.skipped)} bad item(s), kept {len(ds)}{more}"


def as_uint8_images(arr: np.ndarray, what: str) -> np.ndarray:
    """Validate/convert an image array to uint8 (N, H, W[, C]); floats must lie in [0, 1]."""
    if arr.ndim not in (3, 4) or (arr.ndim == 4 and arr.shape[-1] not in (1, 3, 4)):
        raise DataError(f"{what}: expected images of shape (N, H, W) or (N, H, W, C) with C in 1/3/4, got {arr.shape}")
    if arr.dtype == np.uint8:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and (np.nanmin(arr) < 0.0 or np.nanmax(arr) > 1.0 or np.isnan(arr).any()):
            raise DataError(f"{what}: float images must lie in [0, 1]")
        return np.round(arr * 255.0).astype(np.uint8)
    if np.issubdtype(arr.dtype, np.integer):
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DataError(f"{what}: integer images must lie in [0, 255]")
        return arr.astype(np.uint8)
    raise DataError(f"{what}: unsupported image dtype {arr.dtype}")


def as_labels(arr: np.ndarray, what: str) -> np.ndarray:
    """Validate an integer label vector."""
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise DataError(f"{what}: labels must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size and arr.min() < 0:
        raise DataError(f"{what}: negative label {int(arr.min())}")
    return arr.astype(np.int64)


def default_classes(labels: np.ndarray) -> list[str]:
    """Class names "0" .. str(max label) when a source carries no names."""
    return [str(i) for i in range(int(labels.max()) + 1 if labels.size else 0)]


def check_class_map(source: str, found: Sequence[str], expected: Sequence[str] | None) -> list[str]:
    """The class list to use: ``expected`` when given (``found`` must be a subset of it), else ``found``."""
    if expected is None:
        return list(found)
    unknown = [c for c in found if c not in set(expected)]
    if unknown:
        raise DataError(f"{source}: class {unknown[0]!r} is not among the {len(expected)} expected classes")
    return list(expected)


def relabel(labels: np.ndarray, found: Sequence[str], names: Sequence[str]) -> np.ndarray:
    """Labels indexing ``found`` -> the same classes indexing ``names`` (a superset, maybe reordered)."""
    if list(found) == list(names):
        return labels
    lut = np.asarray([list(names).index(c) for c in found], dtype=np.int64)
    return lut[labels]


# ------------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------------


def open_dataset(
    source: str | os.PathLike[str],
    split: str = "train",
    *,
    skip_bad: bool = False,
    classes: Sequence[str] | None = None,
) -> ImageDataset:
    """Open a labelled image dataset by source and split.

    ``source``: ``"digits"`` (scikit-learn's bundled 8x8 digits; splits train/test, a fixed stratified 80/20
    split), an ImageFolder root, a CIFAR-10/100 python-pickle folder, an ``.npz`` file, or WebDataset tar
    shards (a ``.tar`` file, a folder of them, or a brace pattern ``train-{000..099}.tar``).

    ``skip_bad``: drop unreadable items (zero-byte, corrupt, truncated, empty class folders, samples
    without a label) and list them in ``ds.skipped`` instead of raising DataError.

    ``classes``: the class list the labels must index into (e.g. a checkpoint's); the source's own class
    names must be a subset of it, so indices never shift between a training and an evaluation split.
    """
    name = os.fspath(source)
    expected = list(classes) if classes is not None else None
    if name == "digits":
        from vitkit.data.digits import open_digits

        ds: ImageDataset = open_digits(split)
        names = check_class_map(name, ds.classes, expected)
        ds.labels, ds.classes = relabel(ds.labels, ds.classes, names), names
        return ds
    from vitkit.data.wds import is_shard_source, open_webdataset

    if is_shard_source(name):
        return open_webdataset(name, split, skip_bad=skip_bad, classes=expected)
    path = Path(name)
    if not path.exists():
        raise DataError(f"{name}: no such file or directory (expected 'digits', a folder, an .npz or .tar shards)")
    if path.is_file():
        if path.suffix == ".npz":
            from vitkit.data.npz import open_npz

            return open_npz(path, split, classes=expected)
        raise DataError(f"{name}: unsupported dataset file (expected an .npz, or .tar WebDataset shards)")
    from vitkit.data.cifar import find_cifar, open_cifar

    cifar = find_cifar(path)
    if cifar is not None:
        return open_cifar(cifar, split, classes=expected)
    from vitkit.data.folder import open_image_folder

    return open_image_folder(path, split, skip_bad=skip_bad, classes=expected)


def open_split_or_none(
    source: str | os.PathLike[str],
    split: str,
    *,
    skip_bad: bool = False,
    classes: Sequence[str] | None = None,
) -> ImageDataset | None:
    """``open_dataset``, but None when the source has no such split (any other problem still raises)."""
    try:
        return open_dataset(source, split, skip_bad=skip_bad, classes=classes)
    except MissingSplitError:
        return None
