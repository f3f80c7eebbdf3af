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
number of inputs (each worker keeps ``prefetch + 1`` batch buffers in shared memory and reuses them once the
job's process lets them go). A bad image is an error naming it (DataError), or with ``skip_bad`` an item marked
failed in its batch. :func:`stream_iterable` does the same for a plain iterable (a generator of paths or images), in
this process. A job sharded across processes streams the ``positions`` :func:`vitkit.distributed.shard_steps`
gives it (:mod:`vitkit.inference.jobs`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.multiprocessing.reductions import StorageWeakRef

from vitkit.data import globs
from vitkit.data.folder import IMAGE_EXTENSIONS, is_image_name
from vitkit.errors import DataError
from vitkit.hardware import cpu_count
from vitkit.images import LazyImage, load_image, open_lazy

# (image, its id for errors) -> (C, H, W), or the JPEG's bytes for a decoder downstream (``--decode gpu``)
Transform = Callable[[LazyImage, str], "torch.Tensor | EncodedImage"]
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
            matches = globs.expand(text)
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
    the image files named by ``images`` (:func:`list_inputs`). Nothing is decoded here: with ``skip_bad`` a
    dataset drops only what its listing shows bad (an empty file, a row without a label), and an image that
    does not decode becomes a counted failed row when the stream reaches it (``predecode=False``)."""
    if data:
        from vitkit.data.datasets import open_noted

        return DatasetSource(open_noted(data, split, skip_bad=skip_bad, predecode=False))
    return FileSource(list_inputs(images, skip_bad=skip_bad))


def _images_under(folder: Path) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(folder):  # symbolic links to folders are not followed
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files if is_image_name(f)]
    return sorted(found)


# ---- streaming --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedImage:
    """A JPEG that a worker read and checked (:func:`~vitkit.images.open_lazy`: a regular file
    under the byte cap, a bounded number of scans, the header's size under the pixel limit and accepted by the
    preprocessing) and hands over undecoded, for a batched decoder on the job's device
    (:mod:`vitkit.data.gpu_decode`)."""

    data: bytes
    width: int
    height: int
    name: str


@dataclass
class EncodedBatch:
    """The undecoded JPEGs of a batch, their bytes concatenated into one uint8 tensor (in shared memory when a
    worker made it: one transfer, not one pickle per image). ``rows[i]``: where image ``i`` goes among the
    batch's decoded items; ``sizes[i]``: its (width, height) from the header."""

    data: torch.Tensor  # (total bytes,) uint8
    offsets: np.ndarray  # (n + 1,) int64
    rows: np.ndarray  # (n,) int64
    sizes: np.ndarray  # (n, 2) int64
    names: list[str]

    def __len__(self) -> int:
        return len(self.rows)

    def blob(self, i: int) -> np.ndarray:
        """Image ``i``'s bytes (a view, no copy)."""
        return self.data.numpy()[self.offsets[i] : self.offsets[i + 1]]


@dataclass
class StreamBatch:
    """Consecutive items of a stream: every item's position in the source, id, label and error (None when it
    decoded), and the transformed images of those that decoded, in order."""

    positions: np.ndarray  # (B,) int64 source indices
    ids: list[str]  # (B,)
    labels: np.ndarray  # (B,) int64, -1 without labels
    errors: list[str | None]  # (B,) the reason an item failed (DataError message), else None
    images: torch.Tensor  # (G, C, H, W): the items without an error, G <= B (less ``encoded``: see there)
    slot: int = -1  # the worker's shared buffer holding ``images`` (_Buffers), -1 for none
    # JPEGs left for a decoder on the device (``--decode gpu``): ``images`` then holds the other decoded items,
    # in order, and the engine's feed puts the two together (InferenceEngine.feed)
    encoded: EncodedBatch | None = None

    @property
    def ok(self) -> np.ndarray:
        """(B,) bool: which items decoded (their images are ``images``, in order)."""
        return np.array([e is None for e in self.errors], dtype=bool)

    def __len__(self) -> int:
        return len(self.ids)

    def pin_memory(self) -> StreamBatch:
        """The batch with its images in page-locked memory (``DataLoader(pin_memory=True)`` calls this in its
        pinning thread): a copy to a GPU from there can be asynchronous (``non_blocking``)."""
        return dataclasses.replace(self, images=self.images.pin_memory())


class _Decoded(torch.utils.data.Dataset):
    """Source items by position -> (tensor, or a JPEG's bytes for the device, or None; error or None, label,
    position, id). Errors are returned, not raised, so that a worker process's DataError reaches the job as its
    one-line message."""

    def __init__(self, source: ImageSource, transform: Transform, lazy: bool, on_load: Callable[[], None] | None):
        self.source, self.transform, self.lazy, self.on_load = source, transform, lazy, on_load

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, pos: int) -> tuple[torch.Tensor | EncodedImage | None, str | None, int, int, str]:
        item_id = self.source.item_id(pos)
        try:
            img, label = self.source.load(pos, self.lazy)
            x = self.transform(img, item_id)
        except DataError as e:
            return None, str(e), -1, pos, item_id
        if self.on_load is not None:
            self.on_load()
        return x, None, label, pos, item_id


Item = tuple[torch.Tensor | EncodedImage | None, str | None, int, int, str]


def _collate(items: list[Item], buffers: _Buffers | None = None) -> StreamBatch:
    decoded = [x for x, *_ in items if x is not None]
    good = [x for x in decoded if isinstance(x, torch.Tensor)]
    encoded = [(k, x) for k, x in enumerate(decoded) if isinstance(x, EncodedImage)]
    images, slot = torch.empty(0), -1
    if good:
        images, slot = buffers.stack(good) if buffers is not None else (_stack(good), -1)
    return StreamBatch(
        positions=np.array([p for *_, p, _ in items], dtype=np.int64),
        ids=[i for *_, i in items],
        labels=np.array([lab for _, _, lab, _, _ in items], dtype=np.int64),
        errors=[e for _, e, *_ in items],
        images=images,
        slot=slot,
        encoded=_pack(encoded) if encoded else None,
    )


def _pack(encoded: list[tuple[int, EncodedImage]]) -> EncodedBatch:
    """The JPEGs' bytes in one uint8 tensor (shared memory in a worker), with where each starts."""
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e.data) for _, e in encoded], out=offsets[1:])
    total = int(offsets[-1])
    in_worker = torch.utils.data.get_worker_info() is not None
    data = _shared((total,), torch.empty(0, dtype=torch.uint8)) if in_worker else torch.empty(total, dtype=torch.uint8)
    flat = data.numpy()
    for (_, e), start, end in zip(encoded, offsets[:-1], offsets[1:], strict=True):
        flat[start:end] = np.frombuffer(e.data, dtype=np.uint8)
    return EncodedBatch(
        data=data,
        offsets=offsets,
        rows=np.array([k for k, _ in encoded], dtype=np.int64),
        sizes=np.array([(e.width, e.height) for _, e in encoded], dtype=np.int64).reshape(-1, 2),
        names=[e.name for _, e in encoded],
    )


def _stack(images: list[torch.Tensor]) -> torch.Tensor:
    """The images as one (G, C, H, W) tensor; in a worker process straight into shared memory (as PyTorch's
    default collate does), which is how the batch reaches the job's process: one copy, not a stack and then a
    copy into shared memory when it is sent."""
    if torch.utils.data.get_worker_info() is None:
        return torch.stack(images)
    first = images[0]
    return torch.stack(images, out=_shared((len(images), *first.shape), first))


def _shared(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    storage = like._typed_storage()._new_shared(int(np.prod(shape)), device=like.device)
    return like.new(storage).resize_(*shape)


class _Buffers:
    """Shared-memory batch buffers that the decoding workers reuse, ``slots`` each, instead of a new one per
    batch. A new buffer costs twice: the worker faults in every page, and the job's process, dropping the last
    reference, frees every page (measured 5.5 ms of the job's CPU per uint8 batch of 256 at 224 px, 24 ms in
    float32: most of what receiving a batch cost it). A slot is reused only once the job's process no longer
    holds its last batch (any view of it counted: ``StorageWeakRef`` of its storage, polled as batches
    arrive) -- ``flags``, shared, says which are held -- and a worker whose slots are all held stacks into a
    new buffer as before. So a consumer may keep a batch (or a view of its images) as long as it likes."""

    def __init__(self, workers: int, slots: int, batch_size: int) -> None:
        self.slots, self.batch_size = slots, batch_size
        self.flags = torch.zeros(workers * slots, dtype=torch.uint8).share_memory_()
        self._mine: list[torch.Tensor | None] = [None] * slots  # in a worker: its buffers
        self._next = 0
        self._held: list[tuple[int, Any]] = []  # in the job's process: (slot, weak reference to its storage)

    def stack(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """In a worker: the images stacked into a free slot of its own (marked held), or into a new buffer
        (-1) when every slot is held or the images do not fit."""
        info = torch.utils.data.get_worker_info()
        first = images[0]
        if info is None or len(images) > self.batch_size:
            return _stack(images), -1
        for _ in range(self.slots):
            k, self._next = self._next, (self._next + 1) % self.slots
            slot = info.id * self.slots + k
            if self.flags[slot]:
                continue
            buf = self._mine[k]
            if buf is None or buf.shape[1:] != first.shape or buf.dtype != first.dtype:
                buf = self._mine[k] = _shared((self.batch_size, *first.shape), first)
            self.flags[slot] = 1
            return torch.stack(images, out=buf[: len(images)]), slot
        return _stack(images), -1

    def track(self, batch: StreamBatch) -> None:
        """In the job's process, for each batch as it arrives: free the slots whose batches it no longer holds,
        and watch this one's."""
        held = []
        for slot, ref in self._held:
            if ref.expired():
                self.flags[slot] = 0
            else:
                held.append((slot, ref))
        if batch.slot >= 0 and batch.images.is_pinned():  # a copy: the pinning thread let the buffer go
            self.flags[batch.slot] = 0
        elif batch.slot >= 0:
            held.append((batch.slot, StorageWeakRef(batch.images.untyped_storage())))
        self._held = held


WORKER_TIMEOUT = 600  # seconds a decoding worker may take for one batch before the job stops (never a hang)


def _checked(batches: Iterable[StreamBatch], skip_bad: bool, buffers: _Buffers | None = None) -> Iterator[StreamBatch]:
    try:
        for b in batches:
            if buffers is not None:
                buffers.track(b)
            if not skip_bad:
                bad = next((e for e in b.errors if e is not None), None)
                if bad is not None:
                    raise DataError(bad)
            yield b
    except RuntimeError as e:  # the DataLoader's timeout: one line, not a traceback
        if "timed out" not in str(e):
            raise
        raise DataError(
            f"a decoding worker gave no batch in {WORKER_TIMEOUT} s; stopped (a file that never ends?)"
        ) from None


def stream_batches(
    source: ImageSource,
    transform: Transform,
    batch_size: int,
    *,
    positions: Sequence[int] | None = None,
    workers: int = 0,
    prefetch: int = 2,
    skip_bad: bool = False,
    lazy: bool | None = None,
    on_load: Callable[[], None] | None = None,
) -> Iterator[StreamBatch]:
    """Batches of ``transform``-ed items of ``source`` at ``positions`` (default ``range(len(source))``), in
    that order. ``workers`` decoding processes (0: this process), each
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
    keys = [list(order[s : s + batch_size]) for s in range(0, len(order), batch_size)]
    lazy = bool(getattr(transform, "lazy", False)) if lazy is None else lazy
    buffers = _Buffers(workers, prefetch + 1, batch_size) if workers else None
    loader = torch.utils.data.DataLoader(
        _Decoded(source, transform, lazy, on_load),
        batch_sampler=keys,
        num_workers=workers,
        collate_fn=functools.partial(_collate, buffers=buffers),
        prefetch_factor=prefetch if workers else None,
        timeout=WORKER_TIMEOUT if workers else 0,
    )
    batches: Iterator[StreamBatch] = iter(loader)  # the workers start now
    if workers:
        batches = _released_after(batches, len(keys))
    return _checked(batches, skip_bad, buffers)


def _released_after(batches: Iterator[StreamBatch], count: int) -> Iterator[StreamBatch]:
    """The DataLoader's ``count`` batches; once the last has arrived, its workers are shut down in a background
    thread. The DataLoader does it in the job's thread when asked for a batch after the last (a loop to the end)
    or when the iterator is collected (a job that stops at its count, as ``run_job`` does): it joins each
    worker in turn, waiting for the process to exit, and the job waited with it -- 2.9 s of an H100 eval's main
    process (cProfile, 15 workers; 40-60 ms for 2-8 workers on 2 cores). The workers are idle then (every batch
    has arrived), and the thread holds the iterator until they are gone, so it is not collected meanwhile."""
    for k in range(count):
        b = next(batches)
        if k == count - 1:
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                # not a daemon: the interpreter joins it before finalising (a daemon thread still inside the
                # DataLoader's shutdown at exit aborted a predict process: "terminate called without an active
                # exception")
                threading.Thread(target=shutdown, name="vitkit-workers-exit").start()
        yield b


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
    chunk: list[Item] = []

    def decode(pos: int, img: Any, item_id: str, label: int) -> Item:
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


def default_workers(cores: int | None = None, gpu: bool = False) -> int:
    """Decoding processes for a batch job on ``cores`` CPU cores (default: those this process may run on). The
    model on the CPU: one per four cores, at least one, at most eight -- its forward pass keeps every core busy,
    so decoding only needs to keep up with it (on 2 cores one worker measured best; BENCHMARKS.md, batch
    inference). The model on a GPU (``gpu``): every core but the job's own, at most 16 -- decoding is then the
    whole CPU's work (an H100 runs B/16 at ~10,000 img/s; one core decodes ~800 photos a second)."""
    if cores is None:
        cores = cpu_count()
    if gpu:
        return max(1, min(16, cores - 1))
    return max(1, min(8, cores // 4))
