"""The inputs of the batch jobs (``predict``, ``eval``, ``fewshot``, ``embed``), streamed: decoded as they are
needed, in worker processes, in input order, with bounded prefetch.

An :class:`ImageSource` gives random access to a job's images: ``len``, an id per item (a file path, a shard
member, a dataset row), the image (a JPEG may come back read and not decoded, for
:class:`~vitkit.data.eval_transform.EvalTransform`'s reduced-scale decode) and its label. Sources:

- :class:`FileSource`: image files, from :func:`list_inputs` (files, folders searched recursively, glob
  patterns);
- :class:`DatasetSource`: any map-style dataset (every ``--data`` source :func:`vitkit.data.datasets.open_dataset`
  opens: ImageFolder, WebDataset shards, Hugging Face datasets, ``.npz``, digits).

:func:`stream_batches` runs a transform over the items of a source at ``positions`` (default: all, in order),
from the ``start``-th on (resuming), and yields :class:`StreamBatch` es in that order. With ``workers`` > 0 the
decoding runs in that many processes (``torch.utils.data.DataLoader``), each holding at most ``prefetch``
batches ahead, so memory is bounded by ``(workers x prefetch + 1) x batch_size`` decoded images whatever the
number of inputs. A bad image is an error naming it (DataError), or with ``skip_bad`` an item marked failed in
its batch. :func:`stream_iterable` does the same for a plain iterable (a generator of paths or images), in
this process. Sharding a job across processes is choosing ``positions`` (e.g. ``range(rank, n, world)``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import LazyImage, load_image, open_lazy
from vitkit.data.folder import IMAGE_EXTENSIONS
from vitkit.errors import DataError

Transform = Callable[[LazyImage, str], torch.Tensor]  # (image, its id for errors) -> (C, H, W)
GLOB_CHARS = frozenset("*?[")


# ---- sources ----------------------------------------------------------------------------------------------


class ImageSource:
    """Random access to a job's images. Subclasses implement ``__len__``, :meth:`item_id` and :meth:`load`."""

    def __len__(self) -> int:
        raise NotImplementedError

    def item_id(self, index: int) -> str:
        """The id written beside item ``index``'s results: its path, shard member or dataset row."""
        raise NotImplementedError

    def load(self, index: int, lazy: bool) -> tuple[LazyImage, int]:
        """Item ``index``: (image, label; -1 without labels). ``lazy``: a JPEG may come back read and not yet
        decoded. Raises DataError naming the item when it cannot be read."""
        raise NotImplementedError


class FileSource(ImageSource):
    """Image files (no labels): ids are the paths as given or found."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def item_id(self, index: int) -> str:
        return self.paths[index]

    def load(self, index: int, lazy: bool) -> tuple[LazyImage, int]:
        path = self.paths[index]
        return (open_lazy(path) if lazy else load_image(path)), -1


class DatasetSource(ImageSource):
    """A map-style dataset (``len``, ``ds[i] -> (image, label)``; ``lazy_item`` and ``describe`` used when it
    has them, as every ``open_dataset`` source does): ids are ``ds.describe(i)`` (the file of an ImageFolder,
    ``shard.tar:member`` of WebDataset shards, the row of a Hugging Face dataset, ``source[i]`` of arrays), or
    the index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def item_id(self, index: int) -> str:
        describe = getattr(self.dataset, "describe", None)
        return str(describe(index)) if describe is not None else str(index)

    def load(self, index: int, lazy: bool) -> tuple[LazyImage, int]:
        item = self.dataset.lazy_item(index) if lazy and hasattr(self.dataset, "lazy_item") else self.dataset[index]
        img, label = item
        return img, int(label)


def list_inputs(args: Sequence[str | os.PathLike[str]], *, skip_bad: bool = False) -> list[str]:
    """Image files named by ``args``, in order: a file as it is; a folder: every image in it and its sub-folders
    (by extension, hidden entries skipped, sorted); a glob pattern (``*``, ``?``, ``[``; ``**`` recursive): its
    matches, sorted. Nothing is decoded here.

    Raises DataError naming the argument for a missing file, a folder without images or a pattern matching
    nothing; with ``skip_bad`` a missing file is kept (its item fails when read, naming it).
    """
    out: list[str] = []
    for arg in args:
        text = os.fspath(arg)
        path = Path(text)
        if path.is_dir():
            found = _images_under(path)
            if not found:
                raise DataError(
                    f"{text}: no image files in it or its sub-folders ({', '.join(sorted(IMAGE_EXTENSIONS))})"
                )
            out += found
        elif not path.exists() and GLOB_CHARS & set(text):
            matches = sorted(m for m in glob.glob(text, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"{text}: the pattern matches no file")
            out += matches
        elif path.exists() or skip_bad:
            out.append(text)
        else:
            raise DataError(f"{text}: no such file")
    return out


def open_source(
    images: Sequence[str | os.PathLike[str]], data: str | None, split: str, *, skip_bad: bool = False
) -> ImageSource:
    """What a batch job (predict, embed) reads: the ``data`` dataset's ``split`` (skipped items noted), or else
    the image files named by ``images`` (:func:`list_inputs`). Nothing is decoded here."""
    if data:
        from vitkit.data.base import note_skipped
        from vitkit.data.datasets import open_dataset

        return DatasetSource(note_skipped(open_dataset(data, split, skip_bad=skip_bad)))
    return FileSource(list_inputs(images, skip_bad=skip_bad))


def _images_under(folder: Path) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(folder):  # symbolic links to folders are not followed
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            os.path.join(root, f) for f in files if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_EXTENSIONS
        ]
    return sorted(found)


# ---- streaming --------------------------------------------------------------------------------------------


@dataclass
class StreamBatch:
    """Consecutive items of a stream: every item's position in the source, id, label and error (None when it
    decoded), and the transformed images of those that decoded, in order."""

    positions: np.ndarray  # (B,) int64 source indices
    ids: list[str]  # (B,)
    labels: np.ndarray  # (B,) int64, -1 without labels
    errors: list[str | None]  # (B,) the reason an item failed (DataError message), else None
    images: torch.Tensor  # (G, C, H, W): the items without an error, G <= B

    @property
    def ok(self) -> np.ndarray:
        """(B,) bool: which items decoded (their images are ``images``, in order)."""
        return np.array([e is None for e in self.errors], dtype=bool)

    def __len__(self) -> int:
        return len(self.ids)


class _Decoded(torch.utils.data.Dataset):
    """Source items by position -> (tensor or None, error or None, label, position, id). Errors are returned,
    not raised, so that a worker process's DataError reaches the job as its one-line message."""

    def __init__(self, source: ImageSource, transform: Transform, lazy: bool, on_load: Callable[[], None] | None):
        self.source, self.transform, self.lazy, self.on_load = source, transform, lazy, on_load

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, pos: int) -> tuple[torch.Tensor | None, str | None, int, int, str]:
        item_id = self.source.item_id(pos)
        try:
            img, label = self.source.load(pos, self.lazy)
            x = self.transform(img, item_id)
        except DataError as e:
            return None, str(e), -1, pos, item_id
        if self.on_load is not None:
            self.on_load()
        return x, None, label, pos, item_id


def _collate(items: list[tuple[torch.Tensor | None, str | None, int, int, str]]) -> StreamBatch:
    good = [x for x, *_ in items if x is not None]
    return StreamBatch(
        positions=np.array([p for *_, p, _ in items], dtype=np.int64),
        ids=[i for *_, i in items],
        labels=np.array([lab for _, _, lab, _, _ in items], dtype=np.int64),
        errors=[e for _, e, *_ in items],
        images=torch.stack(good) if good else torch.empty(0),
    )


WORKER_TIMEOUT = 600  # seconds a decoding worker may take for one batch before the job stops (never a hang)


def _checked(batches: Iterable[StreamBatch], skip_bad: bool) -> Iterator[StreamBatch]:
    try:
        yield from _checked_items(batches, skip_bad)
    except RuntimeError as e:  # the DataLoader's timeout: one line, not a traceback
        if "timed out" not in str(e):
            raise
        raise DataError(
            f"a decoding worker gave no batch in {WORKER_TIMEOUT} s; stopped (a file that never ends?)"
        ) from None


def _checked_items(batches: Iterable[StreamBatch], skip_bad: bool) -> Iterator[StreamBatch]:
    for b in batches:
        if not skip_bad:
            bad = next((e for e in b.errors if e is not None), None)
            if bad is not None:
                raise DataError(bad)
        yield b


def stream_batches(
    source: ImageSource,
    transform: Transform,
    batch_size: int,
    *,
    positions: Sequence[int] | None = None,
    start: int = 0,
    workers: int = 0,
    prefetch: int = 2,
    skip_bad: bool = False,
    lazy: bool | None = None,
    on_load: Callable[[], None] | None = None,
) -> Iterator[StreamBatch]:
    """Batches of ``transform``-ed items of ``source`` at ``positions`` (default ``range(len(source))``), in
    that order, from the ``start``-th position on. ``workers`` decoding processes (0: this process), each
    ``prefetch`` batches ahead at most. ``lazy``: hand the transform JPEGs read and not decoded (default: the
    transform's ``lazy`` attribute, else False). ``on_load``: called where each image is decoded (tests count
    with it; in a worker it runs in the worker). A bad item raises DataError naming it, or with ``skip_bad``
    stays in its batch with its error.

    Worker processes start (and decode) when this is called, so a caller can start the stream before slow set-up
    work (packing a model's weights) and have the first batches ready when it is done.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    order = range(len(source)) if positions is None else positions
    order = order[start:]
    keys = [list(order[s : s + batch_size]) for s in range(0, len(order), batch_size)]
    lazy = bool(getattr(transform, "lazy", False)) if lazy is None else lazy
    loader = torch.utils.data.DataLoader(
        _Decoded(source, transform, lazy, on_load),
        batch_sampler=keys,
        num_workers=workers,
        collate_fn=_collate,
        prefetch_factor=prefetch if workers else None,
        timeout=WORKER_TIMEOUT if workers else 0,
    )
    return _checked(iter(loader), skip_bad)  # iter(): the workers start now


def stream_iterable(
    items: Iterable[tuple[Any, str, int]],
    transform: Transform,
    batch_size: int,
    *,
    skip_bad: bool = False,
    lazy: bool | None = None,
) -> Iterator[StreamBatch]:
    """:func:`stream_batches` for an iterable of (image file path or PIL image, id, label), consumed lazily in
    this process, ``batch_size`` items at a time (positions count from 0)."""
    lazy = bool(getattr(transform, "lazy", False)) if lazy is None else lazy
    chunk: list[tuple[torch.Tensor | None, str | None, int, int, str]] = []

    def decode(pos: int, img: Any, item_id: str, label: int) -> tuple[torch.Tensor | None, str | None, int, int, str]:
        try:
            if not isinstance(img, Image.Image):
                img = open_lazy(img) if lazy else load_image(img)
            return transform(img, item_id), None, label, pos, item_id
        except DataError as e:
            return None, str(e), -1, pos, item_id

    def batches() -> Iterator[StreamBatch]:
        for pos, (img, item_id, label) in enumerate(items):
            chunk.append(decode(pos, img, item_id, label))
            if len(chunk) == batch_size:
                yield _collate(chunk)
                chunk.clear()
        if chunk:
            yield _collate(chunk)

    return _checked(batches(), skip_bad)


def default_workers(cores: int | None = None) -> int:
    """Decoding processes for a batch job on ``cores`` CPU cores (default: those this process may run on):
    one per four cores, at least one, at most eight. The model's forward pass keeps every core busy, so
    decoding only needs to keep up with it: on 2 cores one worker measured best (BENCHMARKS.md, batch
    inference)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // 4))
