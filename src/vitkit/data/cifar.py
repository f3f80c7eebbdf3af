"""CIFAR-10 and CIFAR-100 in their python-pickle release (``cifar-10-batches-py``, ``cifar-100-python``).

The release files are pickles. They are read with a restricted unpickler that can only build plain
containers, strings, numbers and numpy arrays: a file that asks for anything else (code, arbitrary
classes) is rejected with a DataError naming it, so opening a dataset can never execute code.

- CIFAR-10: ``data_batch_1`` .. ``data_batch_5`` (train), ``test_batch``, ``batches.meta`` (label_names).
- CIFAR-100: ``train``, ``test``, ``meta`` (fine_label_names); the 100 fine labels are used.

``data`` is (N, 3072) uint8, channel-major 32x32 (R plane, G plane, B plane).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.data.image_dataset import ArrayDataset, MissingSplitError, check_class_map, relabel, split_candidates
from vitkit.errors import DataError
from vitkit.models.vit import MAX_CLASSES

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


# The largest CIFAR pickle read (CIFAR-100's train file is 155 MB): a larger or sparse file is refused unread
MAX_PICKLE_BYTES = 512 << 20


class _Refused(pickle.UnpicklingError):
    """The pickle asks for a global outside the allow-list."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise _Refused(f"refusing to load {module}.{name}")


def safe_unpickle(path: Path) -> dict[str, Any]:
    """Load a CIFAR pickle (a dict) with only containers and numpy arrays allowed; bytes keys become str. A file
    over :data:`MAX_PICKLE_BYTES` is refused unread."""
    try:
        size = path.stat().st_size
        if size > MAX_PICKLE_BYTES:
            raise DataError(f"{path}: {size} bytes, more than the {MAX_PICKLE_BYTES >> 20} MiB of a CIFAR pickle")
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if not raw:
        raise DataError(f"{path}: empty file (0 bytes)")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _Refused as e:
        raise DataError(f"{path}: not a CIFAR python-pickle file ({e})") from None
    except MemoryError:
        raise DataError(f"{path}: a CIFAR pickle too large to load in memory") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        LookupError,  # an unknown text encoding named inside the pickle
        OverflowError,
    ) as e:
        raise DataError(f"{path}: corrupt or truncated CIFAR pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict in a CIFAR pickle, got {type(obj).__name__}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def find_cifar(path: Path) -> Path | None:
    """The CIFAR release folder at or directly inside ``path`` (None if it is not one)."""
    for cand in (path, path / "cifar-10-batches-py", path / "cifar-100-python"):
        if (cand / "batches.meta").is_file() or ((cand / "meta").is_file() and (cand / "train").is_file()):
            return cand
    return None


def _names(meta: dict[str, Any], key: str, path: Path) -> list[str]:
    """The class names of a meta file: a list of strings holding no more characters than the file itself (a
    pickle can list one string many times by reference; decoding each copy would multiply it)."""
    names = meta.get(key)
    if not isinstance(names, list) or not names:
        raise DataError(f"{path}: no '{key}' list in the CIFAR meta file")
    if len(names) > MAX_CLASSES or not all(isinstance(n, bytes | str) for n in names):
        raise DataError(f"{path}: '{key}' must be a list of at most {MAX_CLASSES} strings")
    if sum(len(n) for n in names) > path.stat().st_size:
        raise DataError(f"{path}: '{key}' holds more characters than the file (strings repeated by reference)")
    try:
        return [n.decode("utf-8") if isinstance(n, bytes) else n for n in names]
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: a class name in '{key}' is not UTF-8 ({e})") from None


def _batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: missing CIFAR batch file")
    d = safe_unpickle(path)
    if "data" not in d or label_key not in d:
        raise DataError(f"{path}: a CIFAR batch needs 'data' and '{label_key}' (found {', '.join(sorted(d))})")
    data = d["data"]  # an array as released, never a list: lists sharing references would expand (1.9 GB from 3.7 KB)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' must be a uint8 (N, 3072) array, got {got}")
    return data, _labels(d[label_key], data.shape[0], path)


def _labels(value: Any, n: int, path: Path) -> np.ndarray:
    """A batch's labels, a list of ints (as released) or a 1-D integer array, checked to be ``n`` of them before
    any is converted."""
    listed = isinstance(value, list)
    if not listed and (not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or value.ndim != 1):
        raise DataError(f"{path}: the labels must be a list or 1-D array of integers")
    if len(value) != n:
        raise DataError(f"{path}: {n} images but {len(value)} labels")
    if listed and not all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in value):
        raise DataError(f"{path}: the labels must be integers")
    return np.asarray(value, dtype=np.int64)


def open_cifar(root: Path, split: str = "train", *, classes: list[str] | None = None) -> ArrayDataset:
    """CIFAR-10 or CIFAR-100 (fine labels) from the release folder; splits "train" and "test"."""
    name = next((s for s in split_candidates(split) if s in ("train", "test")), None)
    if name is None:
        raise MissingSplitError(f"{root}: no split {split!r} in CIFAR (available: train, test)")
    if (root / "batches.meta").is_file():  # CIFAR-10
        found = _names(safe_unpickle(root / "batches.meta"), "label_names", root / "batches.meta")
        files = [root / f"data_batch_{i}" for i in range(1, 6)] if name == "train" else [root / "test_batch"]
        label_key = "labels"
    else:  # CIFAR-100
        found = _names(safe_unpickle(root / "meta"), "fine_label_names", root / "meta")
        files, label_key = [root / name], "fine_labels"
    parts = [_batch(f, label_key) for f in files]
    data = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    for f, (_, lab) in zip(files, parts, strict=True):
        if lab.size and (lab.min() < 0 or lab.max() >= len(found)):
            raise DataError(f"{f}: label {int(lab.max())} is outside the {len(found)} class names of the meta file")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
    names = check_class_map(str(root), found, classes)
    labels = relabel(labels, found, names)
    return ArrayDataset(str(root), name, np.ascontiguousarray(images), labels, names)
