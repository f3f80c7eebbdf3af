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

import time
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from vitkit.serve.routes import ERROR_HANDLERS, add_routes
from vitkit.serve.served_model import ServedModel
from vitkit.serve.server import ServeOptions, Server, ServerMetrics
from vitkit.serve.similar import SimilarImages
from vitkit.version import __version__

ROUTES = ("/predict", "/search", "/thumbnail", "/health", "/metrics", "/model", "/docs", "/openapi.json")


def create_app(served: ServedModel, opts: ServeOptions | None = None, similar: SimilarImages | None = None) -> FastAPI:
    """The FastAPI application; the batcher starts and stops with the application's lifespan (on shutdown
    the server stops accepting, in-flight requests are answered, then the worker drains and exits). With
    ``similar`` (an index the served checkpoint made), ``/search`` answers the nearest indexed images."""
    server = Server(served, opts or ServeOptions(), similar)
    assets = _swagger_assets()
    app = FastAPI(
        title="vitkit serve",
        summary=f"{server.card['name']} ({server.card['checkpoint']}): image classification with a Vision Transformer",
        version=__version__,
        lifespan=server.lifespan,
        docs_url=None if assets else "/docs",
        exception_handlers=ERROR_HANDLERS,
    )
    if assets:  # the docs page's JavaScript and CSS from the installed bundle, not from a CDN
        _local_docs(app, assets)
    add_routes(app, server)
    app.add_middleware(_CountRequests, metrics=server.metrics)
    return app


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
