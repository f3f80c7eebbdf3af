"""The HTTP API of ``vitkit serve``: a FastAPI application around a :class:`ServedModel` and a
:class:`Batcher`.

Endpoints: ``POST /predict`` (raw image bytes or a multipart upload -> top-k JSON; ``?attention=1`` adds
the attention rollout as a base64 PNG); with ``--index``, ``POST /search`` (an image -> its nearest indexed
images, :mod:`vitkit.serve.similar`) and ``GET /search?id=`` (an indexed image's neighbours); ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /model`` (the model card), and FastAPI's OpenAPI schema and docs
(``/openapi.json``, ``/docs``).

Every client mistake is answered with a 4xx status and ``{"detail": "<one clear sentence>"}``: oversized
uploads (413, refused from Content-Length before reading, or while streaming), too many pixels (413, from
the image header before decoding), images the checkpoint's preprocessing refuses (413: a centre crop of a
line of pixels), empty bodies, undecodable or truncated images and multipart uploads without a file (400),
other content types (415), bad query parameters (422). The OpenAPI schema declares each of these (models,
content types), so generated clients and schemathesis see what the server sends.

Load is bounded before any work: a request is admitted only while fewer than ``max_queue`` requests wait
for the model or are being read or decoded (else 503 with Retry-After, before the upload is read), at most
``decoders`` images are decoded at once (each may take hundreds of MB: 40 MP RGBA is 160 MB), each in a worker
process (:mod:`vitkit.serve.decoding`) that is killed when the decoding outlives ``decode_timeout_s`` (413) or its
request gives up. A request that outlives ``timeout_s`` is 504, and gives its decoding slot back at once: its
decoding process is killed, and a thread already preprocessing its image runs on outside the slots, at most
``decoders`` such abandoned threads at once (past that, a timed-out request keeps its slot until its thread is
done). So a decoder bomb costs at most ``decode_timeout_s`` of one core, and never makes the next request wait
longer than that. Open connections are not limited
(an idle one would count as much as a request): one that sends no whole request head within
``header_timeout_s``, or no whole body within ``body_timeout_s`` of its head, is closed, and near the open-file
limit the longest-idle connections make room for new ones (:func:`vitkit.serve.net.server_config`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vitkit.errors import DataError
from vitkit.hardware import cpu_count
from vitkit.images import ImageTooLarge
from vitkit.serve.batcher import Batcher, Closed, QueueFull
from vitkit.serve.decoding import DecoderPool, DecodeTimeout, Decoding
from vitkit.serve.openapi import (
    PREDICT_BODY,
    PREDICT_ERRORS,
    SEARCH_ID_ERRORS,
    HealthAnswer,
    PredictAnswer,
    SearchAnswer,
    error_doc,
)
from vitkit.serve.served_model import Answer, RequestError, ServedModel, png_base64
from vitkit.serve.similar import THUMBNAIL_PX, NotServed, SimilarImages

RAW_TYPES = ("application/octet-stream",)  # besides image/*
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUTES = ("/predict", "/search", "/thumbnail", "/health", "/metrics", "/model", "/docs", "/openapi.json")
_LOG = logging.getLogger("vitkit.serve")


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


class _CountRequests:
    """ASGI middleware: every HTTP response counted by path and status, and its latency observed."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        path = path if path in ROUTES else "other"  # bounded label values
        start, status = time.perf_counter(), [500]

        async def send_status(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytearray:
    """The request body, refusing more than ``limit`` bytes (from Content-Length, or while streaming). Gathered in
    one growing buffer: a list of chunks joined at the end would hold the upload twice while it waits to be
    decoded (measured: benchmarks/serve_memory.py)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise RequestError(413, f"upload of {int(declared)} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise RequestError(413, f"upload exceeds the limit of {limit} bytes")
            body += chunk
    except ClientDisconnect:  # the client left, or its body outlived --body-timeout: nobody reads an answer
        raise RequestError(408, "request body not received (the client left or the body timeout passed)") from None
    return body


async def _multipart_file(request: Request, body: bytearray) -> bytes:
    """The first file of a multipart/form-data body (already read, so within the size limit)."""

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=16)
    except Exception as e:  # malformed multipart (python-multipart / starlette errors)
        raise RequestError(400, f"malformed multipart/form-data body ({e})") from None
    files = [v for v in form.values() if isinstance(v, UploadFile)]
    if not files:
        raise RequestError(400, "multipart upload has no file: send the image as a file field, e.g. -F file=@cat.jpg")
    data = await files[0].read()
    await form.close()
    return data


async def _image_bytes(request: Request, limit: int) -> bytes | bytearray:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "multipart/form-data" and not ctype.startswith("image/") and ctype not in RAW_TYPES:
        raise RequestError(
            415,
            f"Content-Type {ctype} is not accepted: send the image bytes as image/* or application/octet-stream "
            "(curl --data-binary @cat.jpg -H 'Content-Type: image/jpeg'), or a multipart/form-data upload "
            "(curl -F file=@cat.jpg)",
        )
    raw = await _read_body(request, limit)
    body: bytes | bytearray = await _multipart_file(request, raw) if ctype == "multipart/form-data" else raw
    if not body:
        raise RequestError(400, "empty body: send the image file's bytes")
    return body


def create_app(
    served: ServedModel, opts: ServeOptions = ServeOptions(), similar: SimilarImages | None = None
) -> FastAPI:
    """The FastAPI application; the batcher starts and stops with the application's lifespan (on shutdown
    the server stops accepting, in-flight requests are answered, then the worker drains and exits). With
    ``similar`` (an index the served checkpoint made), ``/search`` answers the nearest indexed images."""
    server = _Server(served, opts, similar)
    assets = _swagger_assets()
    app = FastAPI(
        title="vitkit serve",
        summary=f"{server.card['name']} ({server.card['checkpoint']}): image classification with a Vision Transformer",
        version=_version(),
        lifespan=server.lifespan,
        docs_url=None if assets else "/docs",
        exception_handlers=ERROR_HANDLERS,
    )
    if assets:  # the docs page's JavaScript and CSS from the installed bundle, not from a CDN
        _local_docs(app, assets)
    _add_routes(app, server)
    app.add_middleware(_CountRequests, metrics=server.metrics)
    return app


class _Server:
    """What the routes share: the model and its batcher, the limits, the metrics, and two counters that only the
    event loop touches -- requests admitted (past the queue check and not yet in the batcher's queue: reading
    their upload, waiting for a decoding slot, decoding) and decodings abandoned by timed-out requests."""

    def __init__(self, served: ServedModel, opts: ServeOptions, similar: SimilarImages | None = None) -> None:
        self.served, self.opts, self.similar = served, opts, similar
        self.card = served.card() if similar is None else {**served.card(), "search": similar.card()}
        self.batcher: Batcher[tuple[torch.Tensor, bool, bool], Answer] = Batcher(
            self._run, opts.max_batch, opts.max_wait_ms, opts.max_queue
        )
        self.metrics = ServerMetrics(lambda: self.batcher.depth)
        self.batcher.on_batch = self.metrics.observe_batch
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
            raise _Unavailable("not serving (starting up or shutting down)")
        busy = self.batcher.depth + self.admitted
        if busy >= self.opts.max_queue:  # before the upload is read or anything decoded
            raise _Unavailable(
                f"server busy: {busy} requests are waiting or being decoded already (limit {self.opts.max_queue}); "
                "retry shortly"
            )
        self.admitted += 1
        try:
            data = await _image_bytes(request, self.opts.max_upload_bytes)
            x = await self.decode(data)
            del data
            try:
                return self.batcher.submit((x, attention, vector))
            except QueueFull as e:
                raise _Unavailable(f"server busy: {e}; retry shortly") from None
            except Closed as e:
                raise _Unavailable(str(e)) from None
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
                return await run_in_threadpool(self.similar.thumbnail, id, lambda data: self.pool.decode(data, job))
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


def _add_routes(app: FastAPI, server: _Server) -> None:
    """The endpoints, around ``server``."""
    opts = server.opts

    @app.post(
        "/predict",
        summary="classify one image",
        description="Send the image as the raw body (Content-Type image/* or application/octet-stream) or as a "
        "multipart/form-data file. Answers the top-k labels with probabilities; attention=1 adds the attention "
        "rollout (Abnar & Zuidema) as a base64 PNG. Requests are batched with concurrent ones.",
        openapi_extra=PREDICT_BODY,
        response_model=PredictAnswer,
        response_model_exclude_none=True,
        responses=PREDICT_ERRORS,
    )
    async def predict(
        request: Request,
        top_k: int = Query(opts.top_k, ge=1, le=1000, description="how many labels"),
        attention: bool = Query(False, description="add the attention rollout map (base64 PNG)"),
    ) -> Any:
        try:
            return await asyncio.wait_for(server.answer(request, top_k, attention), opts.timeout_s)
        except TimeoutError:
            return _error(504, f"not answered within the request timeout of {opts.timeout_s:g} s")
        except _Unavailable as e:
            return _error(503, str(e), {"Retry-After": "1"})

    if server.similar is not None:
        _add_search_routes(app, server)

    @app.get(
        "/health",
        summary="liveness: 200 while the model worker runs",
        response_model=HealthAnswer,
        responses={503: error_doc("not serving (starting up or shutting down)")},
    )
    async def health() -> Any:
        if not server.batcher.alive:
            return _error(503, "not serving (starting up or shutting down)")
        return {"status": "ok", "queue_depth": server.batcher.depth}

    @app.get("/model", summary="the model card: name, classes, resolution, preprocessing, batching")
    async def model_card() -> Any:
        return {**server.card, "serving": {**asdict(opts), "decoders": opts.decoders}}

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_search_routes(app: FastAPI, server: _Server) -> None:
    """``/search``, with an index: by image (batched with the predictions) and by indexed id."""
    opts, similar = server.opts, server.similar
    assert similar is not None

    @app.post(
        "/search",
        summary="the indexed images most similar to one image",
        description="Send the image as /predict takes it. The served checkpoint embeds it as the index was "
        "embedded and the index answers its nearest images: ids (the indexed paths) and cosine scores, best first.",
        openapi_extra=PREDICT_BODY,
        response_model=SearchAnswer,
        responses=PREDICT_ERRORS,
    )
    async def search(request: Request, top_k: int = Query(10, ge=1, le=1000, description="how many neighbours")) -> Any:
        try:
            return await asyncio.wait_for(server.search(request, top_k), opts.timeout_s)
        except TimeoutError:
            return _error(504, f"not answered within the request timeout of {opts.timeout_s:g} s")
        except _Unavailable as e:
            return _error(503, str(e), {"Retry-After": "1"})

    @app.get(
        "/search",
        summary="the indexed images most similar to an indexed image (itself left out)",
        response_model=SearchAnswer,
        responses=SEARCH_ID_ERRORS,
    )
    async def search_id(
        id: str = Query(..., min_length=1, max_length=4096, description="an id in the index (an indexed path)"),
        top_k: int = Query(10, ge=1, le=1000, description="how many neighbours"),
    ) -> Any:
        try:
            return {"model": server.card["name"], "neighbours": similar.by_id(id, top_k)}
        except DataError:
            return _error(404, "id not in the index")

    @app.get(
        "/thumbnail",
        summary="a small JPEG of an indexed image",
        description=f"The indexed image `id` (an id /search answers), decoded as uploads are and re-encoded as a JPEG "
        f"of at most {THUMBNAIL_PX} pixels a side. Only files of the index are served, and only inside the indexed "
        "folder: an id not in the index, with a `..` part, or whose file is a link out of the folder is 404.",
        response_class=Response,
        responses={
            200: {
                "content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}},
                "description": "the thumbnail",
            },
            404: error_doc("the id is not in the index, or names no image file of the indexed folder"),
            413: error_doc("the indexed image is over the pixel limit or its decoding outlived the decode timeout"),
            422: error_doc("the id missing, empty or too long, or the indexed file is not a decodable image"),
            504: error_doc("not answered within the request timeout"),
        },
    )
    async def thumbnail(
        id: str = Query(..., min_length=1, max_length=4096, description="an id in the index (an indexed path)"),
    ) -> Response:
        try:
            data = await asyncio.wait_for(server.thumbnail(id), opts.timeout_s)
        except TimeoutError:
            return _error(504, f"not answered within the request timeout of {opts.timeout_s:g} s")
        except NotServed as e:
            return _error(404, str(e))
        except ImageTooLarge as e:
            return _error(413, str(e).split(": ", 1)[-1])
        except DataError as e:
            return _error(422, f"the indexed file is not a decodable image ({str(e).split(': ', 1)[-1]})")
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "no-store"})


async def _request_error(request: Request, exc: RequestError) -> Response:
    return _error(exc.status, exc.message)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:  # Allow: the methods of every route of the path (/search has two, each its own route)
        methods = {m for r in request.app.routes if getattr(r, "path", None) == request.url.path
                   for m in getattr(r, "methods", None) or ()}  # fmt: skip
        headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))} if methods else headers
    return _error(exc.status_code, str(exc.detail), headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    parts = [f"{' '.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()]
    return _error(422, "; ".join(parts) or "invalid request")


async def _internal_error(request: Request, exc: Exception) -> Response:
    # the detail (paths, library internals) goes to the server's log, never to the client
    _LOG.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error")


#: Every error as ``{"detail": "<one sentence>"}``.
ERROR_HANDLERS: dict[Any, Any] = {
    RequestError: _request_error,
    StarletteHTTPException: _http_error,
    RequestValidationError: _validation_error,
    Exception: _internal_error,
}


class _Unavailable(Exception):
    pass


def _local_docs(app: FastAPI, assets: str) -> None:
    """``/docs`` with Swagger UI's files served from ``assets`` (the installed bundle)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount("/docs-assets", StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="vitkit serve - API docs",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )


def _swagger_assets() -> str | None:
    """The folder of Swagger UI's files from the ``swagger-ui-bundle`` package, when installed (so /docs works
    on machines without internet access); None: FastAPI's default page, which loads them from a CDN."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return str(swagger_ui_path)


def _version() -> str:
    from vitkit.version import __version__

    return __version__
