"""Frozen features on disk: computed once per weights, data, preprocessing, augmentation pass and precision,
and reused by every later run that asks for the same ones (``vitkit finetune --method linear`` with another
regularisation costs seconds).

Features come from :func:`vitkit.inference.features.extract` -- the one batched forward path of evaluation --
on an :class:`~vitkit.inference.engine.InferenceEngine` at the feature precision (fp32: the model itself, images
decoded at full scale; bf16, int8: the engine's fast path, with the reduced-scale decoding its eval uses), in
chunks of ``CHUNK`` examples, each written as soon as it is computed, so an interrupted run keeps what it
finished and a resumed one computes only the rest. Layout::

    <root>/<key digest>/key.json                    the key in full, compared on every read
    <root>/<key digest>/chunk-000000.safetensors    features (n, R) float32, labels (n,), indices (n,) int64

The key (:func:`feature_key`) names the weights by content (``state_digest``: any changed value, resolution
or head gives another key, whatever file they came from), the data by source, split, size, labels and the
files' sizes and modification times, the preprocessing, the augmentation pass (none, or the transform, seed
and epoch), the feature precision, the device type and torch's version. The folder is a chunk store
(:class:`vitkit.outputs.store.Parts`: each chunk written under a temporary name and renamed); a chunk is only
used when its header, shapes, dtypes, indices and labels are what the key says and its values are finite --
anything else is computed again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from vitkit.checkpoints.loaded import state_digest
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.transforms import TrainTransform, sample_rng, triple
from vitkit.errors import ConfigError, DataError
from vitkit.fileio import write_file_atomic
from vitkit.hub.cache import cache_dir, private_dirs, untrusted
from vitkit.images import LazyImage
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import ExtractOptions, extract
from vitkit.inference.policy import FEATURE_PRECISIONS
from vitkit.models.vit import VisionTransformer
from vitkit.output_paths import check_output_location
from vitkit.outputs.store import Parts

KEY_VERSION = 2  # 2: bf16/int8 features from the engine's own fast path (1: a stand-in model, full decoding)
CHUNK = 2048  # examples per file: what an interrupted run can lose, at most
KEY_FILE = "key.json"
TENSORS = ("features", "labels", "indices")


def default_root() -> Path:
    """``features/`` in vitkit's cache directory (``vitkit.hub.cache.cache_dir``)."""
    return cache_dir() / "features"


def check_root(root: str | os.PathLike[str] | None) -> Path:
    """The cache folder (``root``, default :func:`default_root`), judged before any work: files must be writable
    there, and only this user (or root) may be able to change it and the folders above it -- a head is fitted on
    whatever features it holds (the rule of vitkit's download cache, :func:`vitkit.hub.cache.untrusted`).
    ConfigError naming the folder otherwise."""
    folder = Path(root).expanduser() if root is not None else default_root()
    check_output_location(folder, inside=True)
    existing = next((p for p in (folder, *folder.absolute().parents) if os.path.lexists(p)), None)
    why = untrusted(existing, sticky_ok=existing != folder) if existing is not None else None
    if why is not None:
        raise ConfigError(
            f"feature cache {folder}: {why}: other users could change the features a head is fitted on; make it "
            "private (chmod go-w) or choose another --feature-cache"
        )
    return folder


@dataclass(frozen=True)
class AugmentedPass:
    """One pass of a training augmentation over a dataset: example i transformed with the generator of
    (seed, epoch, i), as the training loader draws it (``vitkit.data.transforms.sample_rng``)."""

    transform: TrainTransform
    seed: int
    epoch: int
    identity: dict[str, Any]  # the augmentation's settings, for the key (e.g. the run's AugConfig)


class _AugmentedView:
    """A map-style dataset whose item i is the augmented (not yet normalised) image of ``dataset[i]``."""

    def __init__(self, dataset: Any, aug: AugmentedPass) -> None:
        self.dataset, self.aug = dataset, aug
        self.classes = dataset.classes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        t = self.aug.transform
        lazy = getattr(self.dataset, "lazy_item", None)
        img: LazyImage
        img, label = lazy(index) if lazy is not None else self.dataset[index]
        return t.augment(img, sample_rng(self.aug.seed, self.aug.epoch, index)), int(label)


def _normaliser(t: TrainTransform) -> Preprocess:
    """The transform's own normalisation, as a Preprocess (augmented images are already at its size)."""
    return Preprocess(t.image_size, triple(t.mean), triple(t.std), interpolation=t.interpolation, grayscale=t.grayscale)


def data_identity(dataset: Any) -> dict[str, Any]:
    """What names a dataset's contents without reading its images: source, split, size, classes, a digest of
    its labels, and of the size and modification time of its files (its own file list when it has one, else
    every file under the source path)."""
    labels = np.asarray(dataset.labels, dtype=np.int64)
    files = hashlib.sha256()
    paths = getattr(dataset, "paths", None)
    source = str(getattr(dataset, "source", ""))
    if paths is None and source and os.path.exists(source):
        root = Path(source)
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for p in paths or []:
        try:
            st = os.stat(p)
            files.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        except OSError:
            files.update(f"{p}|missing\n".encode())
    return {
        "source": os.path.abspath(source) if source and os.path.exists(source) else source,
        "split": getattr(dataset, "split", None),
        "size": len(dataset),
        "classes": list(dataset.classes),
        "labels": hashlib.sha256(labels.tobytes()).hexdigest(),
        "files": files.hexdigest(),
    }


def backbone_digest(model: VisionTransformer) -> str:
    """``state_digest`` of every tensor but the head's: what the pre-logits features depend on (so a new head
    never invalidates them)."""
    return state_digest({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})


def feature_key(
    model: VisionTransformer,
    dataset: Any,
    preprocess: Preprocess,
    *,
    augment: AugmentedPass | None = None,
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    weights: str | None = None,
) -> dict[str, Any]:
    """Everything the features depend on (see the module docstring); ``weights``: the model's
    :func:`backbone_digest` when the caller has it already."""
    if precision not in FEATURE_PRECISIONS:
        raise ConfigError(f"feature precision {precision!r}: features are computed in {', '.join(FEATURE_PRECISIONS)}")
    aug = None
    if augment is not None:
        aug = {"settings": augment.identity, "seed": augment.seed, "epoch": augment.epoch}
    return {
        "version": KEY_VERSION,
        "weights": weights or backbone_digest(model),
        "features": "pre_logits",
        "width": model.num_features,
        "data": data_identity(dataset),
        "preprocess": preprocess.to_dict(),
        "augment": aug,
        "precision": precision,
        "device": torch.device(device).type,
        "torch": torch.__version__,
        "chunk": CHUNK,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]


@dataclass
class Features:
    """Features of every example of a dataset, in dataset order, and how many chunks came from the cache."""

    features: np.ndarray  # (N, R) float32
    labels: np.ndarray  # (N,) int64
    cached_chunks: int
    computed_chunks: int
    folder: Path


def cached_features(
    model: VisionTransformer,
    dataset: Any,
    preprocess: Preprocess,
    *,
    root: str | os.PathLike[str] | None = None,
    augment: AugmentedPass | None = None,
    precision: str = "fp32",
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    workers: int = 0,
    progress: bool = True,
    desc: str = "features",
    weights: str | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> Features:
    """Pre-logits features of every example of a map-style ``dataset``: read from the cache under ``root``
    (default :func:`default_root`) where valid, else computed by ``extract`` chunk by chunk and stored.
    ``augment``: features of one augmented pass instead of the clean images. ``on_chunk(i)`` is called after
    chunk i is stored (tests)."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DataError("features for a linear head need a map-style dataset (random access by index)")
    key = feature_key(model, dataset, preprocess, augment=augment, precision=precision, device=device, weights=weights)
    base = check_root(root)
    private_dirs(base)  # missing folders 0700, as vitkit's cache
    folder = base / key_digest(key)
    folder.mkdir(exist_ok=True)
    chunks = Parts(folder, ".safetensors", prefix="chunk-", digits=6, extra=[KEY_FILE])
    key_path = folder / KEY_FILE
    try:
        stored = json.loads(key_path.read_text())
    except (OSError, ValueError):
        stored = None
    if stored != key:  # absent, unreadable or another key under this digest: start the folder anew
        chunks.clear(temporary=False)  # another run filling this folder now keeps the chunk it is writing
        write_file_atomic(key_path, lambda tmp: tmp.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n"))
    source: Any = dataset if augment is None else _AugmentedView(dataset, augment)
    pre = preprocess if augment is None else _normaliser(augment.transform)
    labels = np.asarray(dataset.labels, dtype=np.int64)
    n, width = len(dataset), model.num_features
    feats = np.empty((n, width), dtype=np.float32)
    starts = list(range(0, n, CHUNK))
    cached = computed = 0
    engine: InferenceEngine | None = None  # built for the first missing chunk (nothing to pack when all are cached)
    for c, start in enumerate(starts):
        idx = np.arange(start, min(start + CHUNK, n), dtype=np.int64)
        got = _read_chunk(chunks.path(c), idx, labels[idx], width)
        if got is None:
            what = f"{desc} {c + 1}/{len(starts)}" if len(starts) > 1 else desc
            if engine is None:
                engine = InferenceEngine(model, pre, precision=precision, device=device, batch_size=batch_size)
            run = ExtractOptions(batch_size=batch_size, workers=workers, progress=progress)
            out = extract(engine, source, pre, logits=False, features=True, indices=idx.tolist(), desc=what, opts=run)
            assert out.features is not None
            got = out.features.astype(np.float32, copy=False)
            if not np.array_equal(out.indices, idx) or not np.isfinite(got).all():
                raise DataError(f"{desc}: the model gave non-finite features or skipped examples")
            tensors = {"features": np.ascontiguousarray(got), "labels": labels[idx], "indices": idx}
            chunks.write(c, lambda f, t=tensors: f.write(save(t)))  # type: ignore[misc]
            computed += 1
        else:
            cached += 1
        feats[idx] = got
        if on_chunk is not None:
            on_chunk(c)
    if cached and progress:
        print(f"note: {desc}: {cached} of {len(starts)} chunk(s) from the feature cache {folder}", file=sys.stderr)
    return Features(feats, labels, cached, computed, folder)


def _read_chunk(path: Path, idx: np.ndarray, labels: np.ndarray, width: int) -> np.ndarray | None:
    """A stored chunk's features when they are exactly what is expected (checked from the header before
    anything is read into memory), else None."""
    if not path.is_file():
        return None
    n = len(idx)
    want = {"features": ("F32", [n, width]), "labels": ("I64", [n]), "indices": ("I64", [n])}
    try:
        with safe_open(str(path), "np") as f:
            if sorted(f.keys()) != sorted(TENSORS):
                return None
            for name, (dtype, shape) in want.items():
                sl = f.get_slice(name)
                if sl.get_dtype() != dtype or list(sl.get_shape()) != shape:
                    return None
            got = {name: f.get_tensor(name) for name in TENSORS}
    except (SafetensorError, OSError, ValueError):
        return None
    if not (np.array_equal(got["indices"], idx) and np.array_equal(got["labels"], labels)):
        return None
    feats = got["features"]
    return feats if np.isfinite(feats).all() else None
