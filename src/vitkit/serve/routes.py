"""The endpoints of ``vitkit serve`` (:func:`add_routes`) around a :class:`~vitkit.serve.server.Server`, and the
error handlers that answer every error as ``{"detail": "<one sentence>"}`` (:data:`ERROR_HANDLERS`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from vitkit.errors import DataError
from vitkit.images import ImageTooLarge
from vitkit.serve.openapi import (
    PREDICT_BODY,
    PREDICT_ERRORS,
    SEARCH_ID_ERRORS,
    HealthAnswer,
    PredictAnswer,
    SearchAnswer,
    error_doc,
)
from vitkit.serve.served_model import RequestError
from vitkit.serve.server import Server, Unavailable
from vitkit.serve.similar import THUMBNAIL_PX, NotServed

_LOG = logging.getLogger("vitkit.serve")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def add_routes(app: FastAPI, server: Server) -> None:
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
        except Unavailable as e:
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


def _add_search_routes(app: FastAPI, server: Server) -> None:
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
        except Unavailable as e:
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
