"""Datasets: one interface over the bundled digits, ImageFolder trees, CIFAR, ``.npz`` arrays and WebDataset shards.

``open_dataset(source, split)`` is the single entry point every part of vitkit uses::

    ds = open_dataset("digits", "train")          # scikit-learn's 8x8 digits, fixed stratified split
    ds = open_dataset("path/to/imagenet", "val")  # ImageFolder: <root>/<split>/<class>/<image>
    ds = open_dataset("path/to/cifar-10-batches-py", "test")
    ds = open_dataset("arrays.npz", "train")      # images + labels arrays
    ds = open_dataset("shards/", "train")         # WebDataset tar shards: <root>/<split>-*.tar
    ds = open_dataset("saved/", "test")           # Hugging Face datasets: save_to_disk folder, .parquet/.arrow
    ds = open_dataset("org/name", "train")        # a Hub dataset id from the local datasets cache (offline)

An :class:`ImageDataset` has ``classes`` (index -> name), ``len(ds)``, ``ds[i] -> (PIL RGB image, label)``
and iterates as (image, label) pairs. ``ds.labels`` gives every label without decoding images.

Bad data is never silently absorbed: a corrupt, truncated or zero-byte image, an empty class folder or a
label array that does not match raises :class:`~vitkit.errors.DataError` naming the file. With
``skip_bad=True`` such items are dropped instead and listed in ``ds.skipped`` (class indices never shift:
an empty class folder keeps its index).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitkit.data.image_dataset import ClassMapError, ImageDataset, MissingSplitError, check_class_map, relabel
from vitkit.errors import DataError

# ------------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------------


def open_dataset(
    source: str | os.PathLike[str],
    split: str = "train",
    *,
    skip_bad: bool = False,
    classes: Sequence[str] | None = None,
    strict_classes: bool = True,
    image_column: str | None = None,
    label_column: str | None = None,
    predecode: bool = True,
) -> ImageDataset:
    """Open a labelled image dataset by source and split.

    ``source``: ``"digits"`` (scikit-learn's bundled 8x8 digits; splits train/test, a fixed stratified 80/20
    split), an ImageFolder root, a CIFAR-10/100 python-pickle folder, an ``.npz`` file, or WebDataset tar
    shards (a ``.tar`` file, a folder of them, or a brace pattern ``train-{000..099}.tar``), or a Hugging Face
    dataset (a ``save_to_disk`` folder, ``.parquet``/``.arrow`` files, a Hub id ``org/name`` from the local
    cache; see :mod:`vitkit.data.hf_datasets`; ``image_column`` / ``label_column`` name its columns).

    ``skip_bad``: drop unreadable items (zero-byte, corrupt, truncated, empty class folders, samples
    without a label) and list them in ``ds.skipped`` instead of raising DataError. To find the corrupt and
    truncated ones, every image of an ImageFolder, WebDataset or Hugging Face dataset is decoded once, here;
    ``predecode=False`` leaves that to whoever reads the items (the batch jobs' stream, which makes a bad item a
    counted failed row as it comes: no pass over the whole dataset before the first batch, once per process).

    ``classes``: the class list the labels must index into (e.g. a checkpoint's); the source's own class
    names must be a subset of it, so indices never shift between a training and an evaluation split. With
    ``strict_classes=False`` a source whose names are not a subset keeps its own classes instead of failing
    (evaluation then compares labels by index, or by name when both sides hold the same set).
    """
    try:
        return _open(os.fspath(source), split, skip_bad, classes, image_column, label_column, predecode)
    except ClassMapError:
        if strict_classes:
            raise
        return _open(os.fspath(source), split, skip_bad, None, image_column, label_column, predecode)


def open_noted(source: str, split: str, *, skip_bad: bool = False, **kw: Any) -> ImageDataset:
    """:func:`open_dataset`, and what ``skip_bad`` dropped noted on stderr
    (:func:`~vitkit.data.image_dataset.note_skipped`): how every command opens its ``--data`` (predict and embed
    through ``open_source``, eval, fewshot, knn, analyze)."""
    from vitkit.data.image_dataset import note_skipped

    return note_skipped(open_dataset(source, split, skip_bad=skip_bad, **kw))


def _open(
    name: str,
    split: str,
    skip_bad: bool,
    classes: Sequence[str] | None,
    image_column: str | None,
    label_column: str | None,
    predecode: bool = True,
) -> ImageDataset:
    expected = list(classes) if classes is not None else None
    if name == "digits":
        from vitkit.data.digits import open_digits

        ds: ImageDataset = open_digits(split)
        names = check_class_map(name, ds.classes, expected)
        ds.labels, ds.classes = relabel(ds.labels, ds.classes, names), names
        return ds
    from vitkit.data.wds import is_shard_source, open_webdataset

    if is_shard_source(name):
        return open_webdataset(name, split, skip_bad=skip_bad, classes=expected, predecode=predecode)
    from vitkit.data import hf_datasets as hfd

    if hfd.is_hf_source(name) or hfd.is_hub_dataset_id(name):
        return hfd.open_hf_dataset(
            name,
            split,
            skip_bad=skip_bad,
            classes=expected,
            image_column=image_column,
            label_column=label_column,
            predecode=predecode,
        )
    if image_column is not None or label_column is not None:
        raise DataError(f"{name}: image_column/label_column apply to Hugging Face datasets only")
    path = Path(name)
    if not path.exists():
        raise DataError(
            f"{name}: no such file or directory (expected 'digits', a folder, an .npz, .tar shards, "
            "a Hugging Face dataset or Hub id)"
        )
    if path.is_file():
        if path.suffix == ".npz":
            from vitkit.data.npz import open_npz

            return open_npz(path, split, classes=expected)
        raise DataError(f"{name}: unsupported dataset file (expected .npz, .tar WebDataset shards, .parquet or .arrow)")
    from vitkit.data.cifar import find_cifar, open_cifar

    cifar = find_cifar(path)
    if cifar is not None:
        return open_cifar(cifar, split, classes=expected)
    from vitkit.data.folder import open_image_folder

    return open_image_folder(path, split, skip_bad=skip_bad, classes=expected, predecode=predecode)


def open_split_or_none(
    source: str | os.PathLike[str],
    split: str,
    *,
    skip_bad: bool = False,
    classes: Sequence[str] | None = None,
    predecode: bool = True,
) -> ImageDataset | None:
    """``open_dataset``, but None when the source has no such split (any other problem still raises)."""
    try:
        return open_dataset(source, split, skip_bad=skip_bad, classes=classes, predecode=predecode)
    except MissingSplitError:
        return None
