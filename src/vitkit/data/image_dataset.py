"""What every dataset source builds on: the :class:`ImageDataset` interface, array-backed datasets, split
names, class-map checks and the image/label validation the sources share.

An :class:`ImageDataset` has ``classes`` (index -> name), ``len(ds)``, ``ds[i] -> (PIL RGB image, label)``
and iterates as (image, label) pairs. ``ds.labels`` gives every label without decoding images.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from PIL import Image

from vitkit.errors import DataError
from vitkit.images import EncodedJpeg, LazyImage, convert_image
from vitkit.models.vit import MAX_CLASSES

D = TypeVar("D", bound="ImageDataset")

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


def skip_or_raise(skip_bad: bool, skipped: list[Skipped], item: str, reason: str) -> None:
    """A bad item: with ``skip_bad`` noted in ``skipped``, else a DataError ``"<item>: <reason>"``."""
    if not skip_bad:
        raise DataError(f"{item}: {reason}")
    skipped.append(Skipped(item, reason))


def decodable_items(names: Sequence[str], load: Callable[[int], object], skipped: list[Skipped]) -> list[int]:
    """The indices ``i`` of ``names`` (each item's name in errors) that ``load(i)`` decodes; the others are
    noted in ``skipped`` with the reason their DataError gives."""
    keep: list[int] = []
    for i, where in enumerate(names):
        try:
            load(i)
        except DataError as e:
            skipped.append(Skipped(where, str(e).removeprefix(f"{where}: ")))
            continue
        keep.append(i)
    return keep


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
        index = self._checked(index)
        return convert_image(self.load_image(index), "RGB"), int(self.labels[index])

    def _checked(self, index: int) -> int:
        """``index`` in [0, len), counting negative ones from the end; IndexError outside."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} items")
        return index % n

    def __iter__(self) -> Iterator[tuple[Image.Image, int]]:
        for i in range(len(self)):
            yield self[i]

    def load_image(self, index: int) -> Image.Image:
        """Decode item ``index`` (any mode; ``__getitem__`` converts to RGB). Raises DataError naming it."""
        raise NotImplementedError

    def load_lazy(self, index: int) -> LazyImage:
        """``load_image``, except that a source of encoded images may return a JPEG read and not yet
        decoded (``images.lazy_image``). Sources without encoded images decode as ``load_image`` does."""
        return self.load_image(index)

    def lazy_item(self, index: int) -> tuple[LazyImage, int]:
        """Like ``ds[index]``, but a JPEG may come back read and not yet decoded
        (``images.EncodedJpeg``, RGB or L), for a training transform that decodes only the scale and
        region its random crop needs (``images.decode_crop``); any other image as ``ds[index]``."""
        index = self._checked(index)
        img = self.load_lazy(index)
        return (img if isinstance(img, EncodedJpeg) else convert_image(img, "RGB")), int(self.labels[index])

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


def skipped_note(ds: ImageDataset) -> str | None:
    """The one-line account of what ``skip_bad`` dropped from ``ds`` (None when nothing was), for the console:
    how many items, and the first one with its reason."""
    if not ds.skipped:
        return None
    first = ds.skipped[0]
    first_one = f"first: {first.item}: {first.reason}"
    return f"{ds.source} [{ds.split}]: skipped {len(ds.skipped)} bad item(s), kept {len(ds)} ({first_one})"


def note_skipped(ds: D) -> D:
    """Print what ``skip_bad`` dropped from ``ds`` to stderr (one "note:" line, nothing when nothing was), and
    return ``ds``: what ``vitkit train`` and the evaluation commands show."""
    note = skipped_note(ds)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return ds


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
    if arr.size and int(arr.max()) >= MAX_CLASSES:
        raise DataError(f"{what}: label {int(arr.max())} is above {MAX_CLASSES - 1}, the most classes vitkit takes")
    return arr.astype(np.int64)


def default_classes(labels: np.ndarray) -> list[str]:
    """Class names "0" .. str(max label) when a source carries no names (at most :data:`MAX_CLASSES`)."""
    if labels.size and int(labels.max()) >= MAX_CLASSES:
        raise DataError(f"label {int(labels.max())} is above {MAX_CLASSES - 1}, the most classes vitkit takes")
    return [str(i) for i in range(int(labels.max()) + 1 if labels.size else 0)]


class ClassMapError(DataError):
    """The source names a class that is not among the expected ones."""


def check_class_map(source: str, found: Sequence[str], expected: Sequence[str] | None) -> list[str]:
    """The class list to use: ``expected`` when given (``found`` must be a subset of it), else ``found``."""
    if expected is None:
        return list(found)
    unknown = [c for c in found if c not in set(expected)]
    if unknown:
        raise ClassMapError(f"{source}: class {unknown[0]!r} is not among the {len(expected)} expected classes")
    return list(expected)


def relabel(labels: np.ndarray, found: Sequence[str], names: Sequence[str]) -> np.ndarray:
    """Labels indexing ``found`` -> the same classes indexing ``names`` (a superset, maybe reordered)."""
    if list(found) == list(names):
        return labels
    lut = np.asarray([list(names).index(c) for c in found], dtype=np.int64)
    return lut[labels]
