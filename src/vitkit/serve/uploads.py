"""Reading an uploaded image from an HTTP request: the raw body (``image/*``, ``application/octet-stream``) or a
multipart/form-data file, refused (:class:`RequestError`, a 4xx status) when too large, empty, malformed or of
another content type -- before more than the size limit is read."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request

from vitkit.serve.served_model import RequestError

RAW_TYPES = ("application/octet-stream",)  # besides image/*


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


async def image_bytes(request: Request, limit: int) -> bytes | bytearray:
    """The uploaded image's bytes, at most ``limit`` of them, or RequestError (400, 408, 413, 415)."""
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
