"""What the routes of ``vitkit serve`` share (:class:`Server`): the served model and its batcher, the limits
(:class:`ServeOptions`), the Prometheus metrics, the decoding slots, and admission -- a request is read and decoded
only while fewer than ``max_queue`` others wait (see :mod:`vitkit.serve.app` for the whole design)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.concurrency import run_in_threadpool

from vitkit.errors import DataError
from vitkit.hardware import cpu_count
from vitkit.images import ImageTooLarge
from vitkit.serve.batcher import Batcher, Closed, QueueFull
from vitkit.serve.decoding import DecoderPool, DecodeTimeout, Decoding
from vitkit.serve.served_model import Answer, RequestError, ServedModel, png_base64
from vitkit.serve.similar import SimilarImages
from vitkit.serve.uploads import image_bytes

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class ServeOptions:
    """Batching and protection settings of the server (the ``vitkit serve`` options)."""

    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    timeout_s: float = 30.0
    max_upload_bytes: int = 16 << 20
    max_pixels: int = 40_000_000
    top_k: int = 5
    max_decoding: int = 0  # images decoded at once; 0: one per CPU core, at most max_queue
    header_timeout_s: float = 10.0  # a connection without a whole request head this long is closed
    body_timeout_s: float = 30.0  # a request whose body has not all arrived this long after its head: 408, closed
    decode_timeout_s: float = 10.0  # an image whose decoding takes longer: its worker process is killed, 413

    @property
    def decoders(self) -> int:
        """Images decoded and preprocessed at once (the rest of the admitted requests wait, holding only
        their upload): ``max_decoding``, or one per CPU core available to this process, at most ``max_queue``."""
        if self.max_decoding > 0:
            return self.max_decoding
        return max(1, min(self.max_queue, cpu_count()))


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own (no process-global state)."""

    def __init__(self, depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vitkit_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.latency = Histogram(
            "vitkit_request_latency_seconds", "request latency by path", ["path"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "vitkit_batch_size", "images per forward pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.batch_seconds = Histogram(
            "vitkit_batch_seconds", "compute time per batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("vitkit_queue_depth", "requests waiting for the model", registry=r)
        self.queue_depth.set_function(depth)

    def observe_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)


class Unavailable(Exception):
    """Not admitted now (starting, stopping, or the queue is full): 503 with Retry-After."""


class Server:
    """What the routes share: the model and its batcher, the limits, the metrics, and two counters that only the
    event loop touches -- requests admitted (past the queue check and not yet in the batcher's queue: reading
    their upload, waiting for a decoding slot, decoding) and decodings abandoned by timed-out requests."""

    def __init__(self, served: ServedModel, opts: ServeOptions, similar: SimilarImages | None = None) -> None:
        self.served, self.opts, self.similar = served, opts, similar
        self.card = served.card() if similar is None else {**served.card(), "search": similar.card()}
        self.metrics = ServerMetrics(lambda: self.batcher.depth)
        self.batcher: Batcher[tuple[torch.Tensor, bool, bool], Answer] = Batcher(
            self._run, opts.max_batch, opts.max_wait_ms, opts.max_queue, self.metrics.observe_batch
        )
        self.admitted = 0
        self.abandoned = 0  # decodings of timed-out requests still running, outside the slots
        self.decoding = asyncio.Semaphore(opts.decoders)  # replaced by one of the serving event loop
        self.pool = self._pool()  # replaced as the application starts

    def _pool(self) -> DecoderPool:
        mode = "L" if self.served.preprocess.grayscale else "RGB"  # what the model's preprocessing converts to
        return DecoderPool(self.opts.max_pixels, self.opts.decode_timeout_s, mode)

    def _run(self, items: list[tuple[torch.Tensor, bool, bool]]) -> list[Answer]:
        """One batch: probabilities (and rollouts) for every image, vectors for those that search."""
        preds = self.served.run_batch([x for x, _, _ in items], [a for _, a, _ in items])
        wanted = [i for i, (_, _, v) in enumerate(items) if v]
        if wanted and self.similar is not None:
            vectors = self.similar.vectors(self.served, torch.stack([items[i][0] for i in wanted]))
            for j, i in enumerate(wanted):
                preds[i] = replace(preds[i], vector=vectors[j])
        return preds

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The batcher's worker runs while the application does."""
        self.decoding = asyncio.Semaphore(self.opts.decoders)  # of this event loop
        self.abandoned = 0
        self.pool = self._pool()
        await run_in_threadpool(self.pool.warm, self.opts.decoders)
        self.batcher.start()
        try:
            yield
        finally:
            await run_in_threadpool(self.batcher.close)
            await run_in_threadpool(self.pool.close)

    def prepare(self, data: bytes | bytearray, job: Decoding) -> torch.Tensor:
        """Untrusted bytes -> the model input, or RequestError (400 undecodable, 413 too large or too costly). The
        bytes are decoded in a worker process (:mod:`vitkit.serve.decoding`), killed at ``decode_timeout_s`` or
        when ``job`` is cancelled; the decoded image is preprocessed here, in the decoding thread."""
        try:
            return self.served.to_tensor(self.pool.decode(data, job))
        except DecodeTimeout as e:
            if job.cancelled:
                raise
            limit = self.opts.decode_timeout_s
            raise RequestError(413, f"image not decoded within the decode timeout of {limit:g} s ({e})") from None
        except ImageTooLarge as e:  # a decompression bomb, or a centre crop of a line of pixels
            raise RequestError(413, str(e)) from None
        except DataError as e:
            raise RequestError(400, str(e)) from None
        except OSError as e:  # no worker process could be started (process or descriptor limits)
            raise RequestError(503, f"cannot start an image decoder now ({e.strerror or e}); retry shortly") from None

    async def decode(self, data: bytes | bytearray) -> torch.Tensor:
        """``prepare`` in a worker thread, at most ``opts.decoders`` at once (each image may take hundreds of MB
        decoded). A request that gives up while waiting for a slot never decodes; one that gives up while its
        image is decoded gives its slot to the next request (a decompression bomb that timed out must not make
        the next image wait) and its decoding process is killed; a thread already preprocessing the decoded
        image runs on (threads cannot be stopped): at most ``opts.decoders`` such abandoned threads at once, past
        that the slot stays taken until the thread is done."""
        slots, job = self.decoding, Decoding()
        await slots.acquire()
        task = asyncio.ensure_future(run_in_threadpool(self.prepare, data, job))
        holds, abandoned = [True], [False]

        def give_back() -> None:
            if holds[0]:
                holds[0] = False
                slots.release()

        def done(finished: asyncio.Future[torch.Tensor]) -> None:
            give_back()
            if abandoned[0]:
                self.abandoned -= 1
            if not finished.cancelled():
                finished.exception()  # retrieved: an abandoned request's error is not logged as never retrieved

        task.add_done_callback(done)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the request timed out (or its client left) while its image decodes
            job.cancel()  # its worker process is killed: the thread returns at once, unless it is preprocessing
            if not task.done() and self.abandoned < self.opts.decoders:
                self.abandoned += 1  # runs on outside the slots, counted until its thread is done
                abandoned[0] = True
                give_back()
            raise

    async def admit(self, request: Request, attention: bool, vector: bool = False) -> Future[Answer]:
        """Read and decode the request's image and queue it for the model, refusing (503) before any of that
        while ``max_queue`` requests wait or are being read or decoded."""
        if not self.batcher.alive:
            raise Unavailable("not serving (starting up or shutting down)")
        busy = self.batcher.depth + self.admitted
        if busy >= self.opts.max_queue:  # before the upload is read or anything decoded
            raise Unavailable(
                f"server busy: {busy} requests are waiting or being decoded already (limit {self.opts.max_queue}); "
                "retry shortly"
            )
        self.admitted += 1
        try:
            data = await image_bytes(request, self.opts.max_upload_bytes)
            x = await self.decode(data)
            del data
            try:
                return self.batcher.submit((x, attention, vector))
            except QueueFull as e:
                raise Unavailable(f"server busy: {e}; retry shortly") from None
            except Closed as e:
                raise Unavailable(str(e)) from None
        finally:
            self.admitted -= 1

    async def answer(self, request: Request, top_k: int, attention: bool) -> dict[str, Any]:
        """The ``/predict`` answer: top-k labels, and the attention rollout when asked for."""
        future = await self.admit(request, attention)
        pred: Answer = await asyncio.wrap_future(future)  # cancelled with the request on timeout
        out: dict[str, Any] = {"model": self.card["name"], "top": self.served.top_k(pred.probs, top_k)}
        if attention and pred.rollout is not None:
            out["attention"] = {
                "rollout_png": png_base64(pred.rollout),
                "size": list(pred.rollout.shape),
                "query": "class token" if self.served.model.cfg.class_token else "mean over the patch tokens",
                "encoding": "base64 PNG, 8-bit greyscale, the model input's size; bright = attended",
            }
        return out

    async def thumbnail(self, id: str) -> bytes:
        """The ``GET /thumbnail`` answer: the indexed image's file decoded as uploads are (a worker process, the
        pixel limit and decode timeout, one of the decoding slots), re-encoded small."""
        assert self.similar is not None
        job = Decoding()
        async with self.decoding:
            try:
                return await run_in_threadpool(self.similar.thumbnail, id, lambda d, px: self.pool.decode(d, job, px))
            except asyncio.CancelledError:
                job.cancel()
                raise

    async def search(self, request: Request, top_k: int) -> dict[str, Any]:
        """The ``POST /search`` answer: the uploaded image's nearest indexed images."""
        assert self.similar is not None
        future = await self.admit(request, attention=False, vector=True)
        pred: Answer = await asyncio.wrap_future(future)
        assert pred.vector is not None
        return {"model": self.card["name"], "neighbours": self.similar.neighbours(pred.vector, top_k)}
