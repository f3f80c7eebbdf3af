"""Dynamic batching: requests from many connections gathered into one forward pass.

One worker thread owns the model. A request enqueues its preprocessed image and waits on a future. The
worker takes the oldest request and waits until ``max_batch`` requests are queued or the oldest has
waited ``max_wait_ms`` (counted from its arrival, so under load, when requests queued up during the
previous forward, the next batch leaves at once), runs them as one batch and answers each future. The
queue is bounded: ``submit`` raises :class:`QueueFull` instead of letting it grow, and a request whose
client gave up (its future cancelled) before the worker took it is dropped without compute.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(Exception):
    """The bounded queue holds ``max_queue`` requests already."""


class Closed(Exception):
    """The batcher is shutting down and takes no new requests."""


@dataclass
class Queued(Generic[T, R]):
    """One request waiting in the batcher: its item, the future its answer goes to, when it arrived."""

    item: T
    future: Future[R] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class Batcher(Generic[T, R]):
    """Gathers items into batches for ``run(items) -> results`` (one result per item, same order).

    ``on_batch(size, seconds)`` is called after every batch (metrics). ``start()`` launches the worker;
    ``close()`` stops taking requests, lets the worker answer everything already queued, and joins it.
    """

    def __init__(
        self,
        run: Callable[[list[T]], Sequence[R]],
        max_batch: int = 8,
        max_wait_ms: float = 5.0,
        max_queue: int = 64,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_queue must be positive, max_wait_ms non-negative")
        self.run, self.on_batch = run, on_batch
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait_ms / 1000.0, max_queue
        self._queue: deque[Queued[T, R]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """Requests waiting for the model (not yet in a running batch)."""
        return len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="vitkit-batcher", daemon=True)
            self._thread.start()

    def submit(self, item: T) -> Future[R]:
        job: Queued[T, R] = Queued(item)
        with self._cond:
            if self._closing or self._thread is None:
                raise Closed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting already (limit {self.max_queue})")
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _next_batch(self) -> list[Queued[T, R]] | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            deadline = self._queue[0].arrived + self.max_wait
            while len(self._queue) < self.max_batch and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            n = min(self.max_batch, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def _loop(self) -> None:
        while (taken := self._next_batch()) is not None:
            jobs = [j for j in taken if j.future.set_running_or_notify_cancel()]  # drop abandoned requests
            if not jobs:
                continue
            start = time.perf_counter()
            try:
                results: Sequence[Any] = self.run([j.item for j in jobs])
                if len(results) != len(jobs):
                    raise RuntimeError(f"batch of {len(jobs)} gave {len(results)} results")
            except BaseException as e:  # never let one bad batch kill the worker
                for j in jobs:
                    j.future.set_exception(e)
                continue
            for j, r in zip(jobs, results, strict=True):
                j.future.set_result(r)
            if self.on_batch is not None:
                self.on_batch(len(jobs), time.perf_counter() - start)
