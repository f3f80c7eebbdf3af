"""Class names shipped with vitkit: ImageNet-1k and ImageNet-21k (see resources/LABELS_NOTICE.md)."""

from __future__ import annotations

import gzip
from functools import cache
from importlib import resources

LABEL_SETS = ("imagenet-1k", "imagenet-21k")


def _resource(name: str) -> bytes:
    return resources.files("vitkit").joinpath("resources", name).read_bytes()


@cache
def _imagenet1k() -> tuple[str, ...]:
    return tuple(_resource("imagenet1k_labels.txt").decode("utf-8").splitlines())


@cache
def _imagenet21k() -> tuple[tuple[str, str], ...]:
    text = gzip.decompress(_resource("imagenet21k_labels.tsv.gz")).decode("utf-8")
    return tuple(tuple(line.split("\t", 1)) for line in text.splitlines())  # type: ignore[misc]


def label_names(label_set: str) -> list[str]:
    """The class names of ``label_set`` ("imagenet-1k" or "imagenet-21k") in index order."""
    if label_set == "imagenet-1k":
        return list(_imagenet1k())
    if label_set == "imagenet-21k":
        return [lemma for _, lemma in _imagenet21k()]
    raise KeyError(f"unknown label set {label_set!r}; known: {', '.join(LABEL_SETS)}")


def label_set_for(num_classes: int) -> str | None:
    """The shipped label set a head of ``num_classes`` outputs most likely uses (1000 or 21843), else None."""
    return {1000: "imagenet-1k", 21843: "imagenet-21k"}.get(num_classes)
