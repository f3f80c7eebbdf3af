"""A stratified held-out slice of a data set, and the rest of it: the validation split that fine-tuning selects
its weights on when the data set has none of its own (``vitkit finetune``, ``adapt.select``)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from vitkit.data.image_dataset import ImageDataset
from vitkit.images import LazyImage


def stratified_holdout(
    labels: np.ndarray, num_classes: int, fraction: float, seed: int, *, salt: int = 0x5E1C
) -> np.ndarray | None:
    """A boolean mask over examples: ``fraction`` of every class (at least one, never all) held out, drawn from
    (seed, class, salt); None when some class has fewer than two examples (nothing would be left to train on).
    ``salt`` keeps apart the draws of two uses of one seed (the validation split; the probe's L2 choice)."""
    labels = np.asarray(labels, dtype=np.int64)
    counts = np.bincount(labels, minlength=num_classes)
    if len(labels) == 0 or counts.min() < 2:
        return None
    held = np.zeros(len(labels), dtype=bool)
    for c in range(num_classes):
        members = np.flatnonzero(labels == c)
        rng = np.random.default_rng([seed, c, salt])
        held[rng.permutation(members)[: holdout_count(len(members), fraction)]] = True
    return held


def holdout_count(members: int, fraction: float) -> int:
    """How many of a class's ``members`` (>= 2) :func:`stratified_holdout` holds out."""
    return min(members - 1, max(1, round(fraction * members)))


class Subset(ImageDataset):
    """Some examples of ``base`` (``indices`` into it, in that order), as a data set of their own named
    ``split`` (``train[-heldout]``, ``train[heldout]``): its own labels, so its feature-cache key differs."""

    def __init__(self, base: ImageDataset, indices: np.ndarray, split: str) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        super().__init__(base.source, split, base.classes, base.labels[self.indices])
        paths = getattr(base, "paths", None)
        if paths is not None:
            self.paths = [paths[i] for i in self.indices]

    def load_image(self, index: int) -> Image.Image:
        return self.base.load_image(int(self.indices[index]))

    def load_lazy(self, index: int) -> LazyImage:
        return self.base.load_lazy(int(self.indices[index]))

    def describe(self, index: int) -> str:
        return self.base.describe(int(self.indices[index]))


def split_off(dataset: ImageDataset, fraction: float, seed: int) -> tuple[ImageDataset, ImageDataset] | None:
    """(the rest, the held-out slice) of ``dataset``: :func:`stratified_holdout`; None when it cannot be made."""
    held = stratified_holdout(dataset.labels, dataset.num_classes, fraction, seed)
    if held is None:
        return None
    name = dataset.split
    rest = Subset(dataset, np.flatnonzero(~held), f"{name}[-heldout]")
    return rest, Subset(dataset, np.flatnonzero(held), f"{name}[heldout]")
