"""Small in-memory datasets that follow vitkit's data interface, and a tiny model, for evaluation tests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from PIL import Image

from helpers import randomize_
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer

PRE = Preprocess(image_size=(16, 24))


class ListDataset:
    """Map-style: ``classes``, ``len``, ``[i] -> (PIL image, label)``, iteration; optional ``labels``."""

    def __init__(self, images: list[Image.Image], labels: list[int], classes: list[str], expose: bool) -> None:
        self.images, self._labels, self.classes = images, labels, classes
        if expose:
            self.labels = labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        return self.images[i], self._labels[i]

    def __iter__(self) -> Iterator[tuple[Image.Image, int]]:
        return (self[i] for i in range(len(self)))


class StreamDataset:
    """Iterable-only, like a stream of shards."""

    def __init__(self, inner: ListDataset) -> None:
        self.inner, self.classes = inner, inner.classes

    def __iter__(self) -> Iterator[tuple[Image.Image, int]]:
        return iter(self.inner)


def make_dataset(n: int, K: int = 3, seed: int = 0, expose: bool = False) -> ListDataset:
    rng = np.random.default_rng(seed)
    labels = [int(v) for v in rng.integers(0, K, size=n)]
    images = [Image.fromarray(rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8)) for _ in range(n)]
    return ListDataset(images, labels, [f"c{i}" for i in range(K)], expose)


def make_model(num_classes: int = 3, representation_size: int | None = None) -> VisionTransformer:
    model = create_model(
        "Ti/16", patch_size=8, image_size=(16, 24), hidden_size=32, depth=2, num_heads=2, mlp_dim=32,
        num_classes=num_classes, representation_size=representation_size,
    )  # fmt: skip
    return randomize_(model).eval()  # type: ignore[return-value]
