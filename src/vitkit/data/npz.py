"""Images and labels in a numpy ``.npz`` file (loaded without pickle).

Keys, per split (the first that exists wins):

- ``<split>_images`` / ``<split>_labels`` (e.g. ``train_images``, ``test_labels``), or Keras-style
  ``x_<split>`` / ``y_<split>``;
- for the "train" split only: ``images`` / ``labels`` (or ``x`` / ``y``).

Images are uint8 (N, H, W) or (N, H, W, C) with C in {1, 3, 4}, or floats in [0, 1]. An optional
``classes`` array of strings names the classes; otherwise they are "0" .. str(max label).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitkit.checkpoints.npz_files import NPZ_ERRORS, check_npz_members
from vitkit.data.image_dataset import (
    ArrayDataset,
    MissingSplitError,
    as_labels,
    as_uint8_images,
    check_class_map,
    default_classes,
    relabel,
    split_candidates,
)
from vitkit.errors import DataError


def _keys_for(split: str) -> list[tuple[str, str]]:
    pairs = []
    for s in split_candidates(split):
        pairs += [(f"{s}_images", f"{s}_labels"), (f"x_{s}", f"y_{s}")]
    if split_candidates(split)[0] == "train":
        pairs += [("images", "labels"), ("x", "y")]
    return pairs


def open_npz(path: Path, split: str = "train", *, classes: list[str] | None = None) -> ArrayDataset:
    """One split of an ``.npz`` file as a dataset."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    check_npz_members(path, DataError)  # sizes from the headers before numpy allocates them
    try:
        z = np.load(path, allow_pickle=False)
    except NPZ_ERRORS as e:
        raise DataError(f"{path}: not a readable .npz file ({e})") from None
    with z:
        files = set(z.files)
        pair = next(((i, lab) for i, lab in _keys_for(split) if i in files), None)
        if pair is None:
            wanted = ", ".join(f"{i}/{lab}" for i, lab in _keys_for(split))
            raise MissingSplitError(
                f"{path}: no split {split!r} (looked for {wanted}; found {', '.join(sorted(files))})"
            )
        img_key, lab_key = pair
        if lab_key not in files:
            raise DataError(f"{path}: has '{img_key}' but no '{lab_key}'")
        try:
            images = as_uint8_images(z[img_key], f"{path}:{img_key}")
            labels = as_labels(z[lab_key], f"{path}:{lab_key}")
            found = [str(c) for c in z["classes"].tolist()] if "classes" in files else None
            if found is None and classes is None:  # one class list for every split of the file
                every = [as_labels(z[k], f"{path}:{k}") for k in sorted(files) if k.endswith("labels") or k[:1] == "y"]
                found = default_classes(np.concatenate(every))
        except NPZ_ERRORS as e:  # object arrays refused by allow_pickle=False, corrupt members
            raise DataError(f"{path}: unreadable array ({e})") from None
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{path}: {images.shape[0]} images in '{img_key}' but {labels.shape[0]} labels in '{lab_key}'")
    if found is None:
        found = list(classes or [])
    if labels.size and labels.max() >= len(found):
        raise DataError(f"{path}: label {int(labels.max())} in '{lab_key}' but only {len(found)} names in 'classes'")
    names = check_class_map(str(path), found, classes)
    return ArrayDataset(str(path), split, images, relabel(labels, found, names), names)
