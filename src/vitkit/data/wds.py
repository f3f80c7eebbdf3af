"""WebDataset tar shards: samples are runs of tar members sharing a key (``0001.jpg`` + ``0001.cls``).

Sources: a ``.tar`` file, a brace pattern (``data/train-{000000..000127}.tar``), or a folder holding
``<split>-*.tar`` (or ``<split>/*.tar``; for "train" any ``*.tar`` when there are no split prefixes).
A ``classes.txt`` next to the shards (one name per line) names the classes; otherwise they are
"0" .. str(max label). Labels are the ``.cls`` member (an integer as text).

Opening indexes the shards once (tar headers plus the tiny ``.cls`` members: no image is decoded), so a
shard set is also a map-style dataset: ``ds[i]`` seeks into its shard. The training loader reads shards in
a seeded order and shuffles within windows of a few shards, so reading stays mostly sequential.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vitkit.data.image_dataset import (
    ImageDataset,
    MissingSplitError,
    Skipped,
    check_class_map,
    decodable_items,
    default_classes,
    relabel,
    split_candidates,
)
from vitkit.errors import DataError
from vitkit.images import MAX_IMAGE_BYTES, LazyImage, decode_image, lazy_image
from vitkit.models.vit import MAX_CLASSES

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff", "gif", "pgm")
LABEL_EXTS = ("cls", "label", "target")
MAX_LABEL_BYTES = 64  # a label member is an integer as text
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


MAX_SHARDS = 1_000_000  # a brace pattern naming more shards than this is refused before it is expanded


def iter_braces(pattern: str, limit: int = MAX_SHARDS) -> Iterator[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar, lazily (zero padding kept; several braces ok).

    The count is checked first: a pattern naming more than ``limit`` names is an error naming the pattern.
    """
    parts: list[str] = []  # literal text between the ranges
    ranges: list[tuple[range, int]] = []  # (values, zero-padded width)
    count, start = 1, 0
    for m in _BRACE.finditer(pattern):
        lo, hi = m.group(1), m.group(2)
        if len(lo) > 18 or len(hi) > 18 or int(hi) < int(lo):
            raise DataError(f"{pattern}: invalid range {{{lo}..{hi}}} (ascending, at most 18 digits)")
        count *= int(hi) - int(lo) + 1
        if count > limit:
            raise DataError(f"{pattern}: names more than {limit:,} shards; refusing to expand it")
        parts.append(pattern[start : m.start()])
        ranges.append((range(int(lo), int(hi) + 1), len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0))
        start = m.end()
    tail = pattern[start:]
    for values in itertools.product(*(r for r, _ in ranges)):
        yield "".join(p + str(v).zfill(w) for p, v, (_, w) in zip(parts, values, ranges, strict=True)) + tail


def is_shard_source(name: str) -> bool:
    """Whether ``name`` denotes WebDataset shards (a .tar, a brace pattern, or a folder of .tar files)."""
    if name.endswith(".tar") or ("{" in name and ".tar" in name):
        return True
    p = Path(name)
    return p.is_dir() and any(p.glob("*.tar")) and not any(e.is_dir() for e in p.iterdir() if e.name != "__MACOSX")


def find_shards(name: str, split: str) -> tuple[list[Path], Path]:
    """The shard files of ``split`` and the folder they live in."""
    if "{" in name or name.endswith(".tar"):
        files = []
        for f in map(Path, iter_braces(name)):  # lazily: stops at the first missing shard
            if not f.is_file():
                raise DataError(f"{f}: no such shard")
            files.append(f)
        return files, files[0].parent
    root = Path(name)
    for s in split_candidates(split):
        files = sorted(root.glob(f"{s}-*.tar")) or sorted(root.glob(f"{s}_*.tar")) or sorted((root / s).glob("*.tar"))
        if files:
            return files, files[0].parent
    if split_candidates(split)[0] == "train":
        prefixed = [
            f for f in root.glob("*.tar") if re.match(r"(train|training|val|validation|valid|test)[-_]", f.name)
        ]
        if not prefixed:
            return sorted(root.glob("*.tar")), root
    raise MissingSplitError(f"{root}: no shards for split {split!r} (expected {split}-*.tar)")


def _split_name(member: str) -> tuple[str, str]:
    """ "dir/0001.seg.png" -> ("dir/0001", "seg.png"): the key ends at the first dot of the file name."""
    head, _, base = member.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext.lower() if dot else "")


class WebDataset(ImageDataset):
    """An indexed set of tar shards (map-style; iterating reads shard by shard, in order)."""

    def __init__(
        self,
        source: str,
        split: str,
        shards: list[Path],
        shard_of: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        labels: np.ndarray,
        classes: list[str],
        skipped: list[Skipped],
    ) -> None:
        super().__init__(source, split, classes, labels)
        self.shards = shards
        self.shard_of = shard_of  # (N,) shard index of each sample
        self.offsets = offsets  # (N,) byte offset of the image member's data
        self.sizes = sizes  # (N,) its size
        self.skipped = skipped
        self._files: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:  # open file handles stay in their process
        state = dict(self.__dict__)
        state["_files"] = {}
        return state

    def _member(self, index: int) -> bytes:
        s = int(self.shard_of[index])
        try:
            f = self._files.get(s)
            if f is None:
                f = self._files[s] = open(self.shards[s], "rb")  # noqa: SIM115 (kept open for reuse)
            if not 0 < int(self.sizes[index]) <= MAX_IMAGE_BYTES:  # the index refuses them; a hand-made one too
                raise DataError(f"{self.describe(index)}: an image member of {int(self.sizes[index])} bytes")
            f.seek(int(self.offsets[index]))
            data = f.read(int(self.sizes[index]))
            if len(data) != int(self.sizes[index]):
                raise DataError(f"{self.describe(index)}: truncated shard")
        except OSError as e:
            raise DataError(f"{self.describe(index)}: unreadable shard ({e.strerror or e})") from None
        return bytes(data)

    def load_image(self, index: int) -> Image.Image:
        return decode_image(self._member(index), self.describe(index))

    def load_lazy(self, index: int) -> LazyImage:
        """A JPEG member read from its shard but not decoded (``images.EncodedJpeg``; the training
        transform decodes only what its crop needs); other images decoded as ``load_image``."""
        return lazy_image(self._member(index), functools.partial(self.describe, index))  # named only on an error

    def describe(self, index: int) -> str:
        shard = self.shards[int(self.shard_of[index])]
        with open(shard, "rb") as f:  # name the member from its tar header (only on errors)
            f.seek(max(int(self.offsets[index]) - 512, 0))
            header = f.read(100).split(b"\0", 1)[0].decode("utf-8", "replace")
        return f"{shard}:{header}"

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _index_shard(path: Path, skip_bad: bool, skipped: list[Skipped]) -> tuple[list[int], list[int], list[int]]:
    """(data offsets, sizes, labels) of the complete samples in one shard."""
    offsets: list[int] = []
    sizes: list[int] = []
    labels: list[int] = []
    problems: list[Skipped] = []  # reported after the whole shard is read: truncation explains them first

    def flush(key: str | None, group: dict[str, tarfile.TarInfo], tf: tarfile.TarFile) -> None:
        if key is None:
            return
        img = next((group[e] for e in IMAGE_EXTS if e in group), None)
        lab = next((group[e] for e in LABEL_EXTS if e in group), None)
        problem = None
        if img is None:
            problem = f"sample {key!r} has no image member (found: {', '.join(sorted(group))})"
        elif lab is None:
            problem = f"sample {key!r} has no label member (.cls)"
        elif img.size == 0:
            problem = f"sample {key!r}: empty image member (0 bytes)"
        elif img.size > MAX_IMAGE_BYTES:  # from its tar header: never read
            problem = (
                f"sample {key!r}: an image member of {img.size} bytes, more than the {MAX_IMAGE_BYTES >> 20} MiB "
                "vitkit reads for one image"
            )
        elif lab.size > MAX_LABEL_BYTES:
            problem = f"sample {key!r}: a label member of {lab.size} bytes (an integer takes a few)"
        else:
            f = tf.extractfile(lab)
            text = f.read().decode("utf-8", "replace").strip() if f is not None else ""
            if not re.fullmatch(r"\d+", text):
                problem = f"sample {key!r}: label {text!r} is not a non-negative integer"
            elif int(text) >= MAX_CLASSES:
                problem = f"sample {key!r}: label {text} is above {MAX_CLASSES - 1}, the most classes vitkit takes"
            else:
                offsets.append(img.offset_data)
                sizes.append(img.size)
                labels.append(int(text))
        if problem is not None:
            problems.append(Skipped(f"{path}:{key}", problem))

    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    try:
        with tarfile.open(path, "r:") as tf:
            key: str | None = None
            group: dict[str, tarfile.TarInfo] = {}
            for m in tf:
                if not m.isfile():
                    continue
                k, ext = _split_name(m.name)
                if k != key:
                    flush(key, group, tf)
                    key, group = k, {}
                group[ext] = m
            flush(key, group, tf)
            _check_complete(path, tf.offset)
    except (tarfile.TarError, EOFError, OSError) as e:
        if not skip_bad:
            raise DataError(f"{path}: corrupt or truncated tar shard ({e})") from None
        problems.append(Skipped(str(path), f"corrupt or truncated tar shard ({e}); later samples dropped"))
    if problems and not skip_bad:
        raise DataError(f"{path}: {problems[0].reason}")
    skipped += problems
    end = path.stat().st_size  # a truncated shard may have indexed a sample whose bytes are cut off
    keep = [i for i in range(len(offsets)) if offsets[i] + sizes[i] <= end]
    return [offsets[i] for i in keep], [sizes[i] for i in keep], [labels[i] for i in keep]


def _check_complete(path: Path, end: int) -> None:
    """A complete tar ends with a zero block right after the last member (tarfile stops silently otherwise)."""
    with open(path, "rb") as f:
        f.seek(end)
        block = f.read(512)
    if len(block) < 512 or block.count(0) != 512:
        raise tarfile.ReadError(f"archive ends at byte {end + len(block)} without an end-of-archive block")


def open_webdataset(
    name: str,
    split: str = "train",
    *,
    skip_bad: bool = False,
    classes: list[str] | None = None,
    predecode: bool = True,
) -> WebDataset:
    """Index the shards of ``split`` (headers and labels only) into a dataset; with ``skip_bad`` and
    ``predecode``, every image is decoded once and the bad ones dropped (``open_dataset``)."""
    shards, folder = find_shards(name, split)
    skipped: list[Skipped] = []
    parts = [_index_shard(p, skip_bad, skipped) for p in shards]
    shard_of = np.concatenate([np.full(len(p[0]), i, dtype=np.int64) for i, p in enumerate(parts)])
    offsets = np.asarray([o for p in parts for o in p[0]], dtype=np.int64)
    sizes = np.asarray([s for p in parts for s in p[1]], dtype=np.int64)
    labels = np.asarray([lab for p in parts for lab in p[2]], dtype=np.int64)
    if labels.size == 0:
        raise DataError(f"{name}: no samples in {len(shards)} shard(s) for split {split!r}")
    names_file = folder / "classes.txt"
    if names_file.is_file():
        found = [line.strip() for line in names_file.read_text().splitlines() if line.strip()]
        if labels.max() >= len(found):
            raise DataError(f"{name}: label {int(labels.max())} but only {len(found)} names in {names_file}")
    else:
        found = default_classes(labels) if classes is None else list(classes)
    names = check_class_map(name, found, classes)
    labels = relabel(labels, found, names)
    ds = WebDataset(os.fspath(name), split, shards, shard_of, offsets, sizes, labels, names, skipped)
    return _drop_undecodable(ds) if skip_bad and predecode else ds


def _drop_undecodable(ds: WebDataset) -> WebDataset:
    """``skip_bad``: decode every image once now (as for ImageFolder trees) and drop, counting, the bad ones."""
    keep = decodable_items([ds.describe(i) for i in range(len(ds))], ds.load_image, ds.skipped)
    ds.close()
    if len(keep) == len(ds):
        return ds
    if not keep:
        raise DataError(f"{ds.source}: no readable images for split {ds.split!r} ({len(ds.skipped)} skipped)")
    idx = np.asarray(keep, dtype=np.int64)
    return WebDataset(
        ds.source, ds.split, ds.shards, ds.shard_of[idx], ds.offsets[idx], ds.sizes[idx], ds.labels[idx],
        ds.classes, ds.skipped,
    )  # fmt: skip
