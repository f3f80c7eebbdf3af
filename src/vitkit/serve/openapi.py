"""The OpenAPI description of ``vitkit serve``'s API: the answers' models, the request body of ``POST /predict``
and the errors each endpoint may answer, so that generated clients and schemathesis see what the server sends."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    """Every error the app answers: one sentence."""

    detail: str = Field(description="what is wrong, in one sentence")


class TopClass(BaseModel):
    label: str
    index: int = Field(ge=0, description="class index in the model's output")
    prob: float = Field(ge=0, le=1, description="softmax probability")


class AttentionMap(BaseModel):
    rollout_png: str = Field(description="base64 PNG, 8-bit greyscale")
    size: list[int] = Field(description="(height, width) of the map: the model input's size")
    query: str
    encoding: str


class PredictAnswer(BaseModel):
    model: str = Field(description="the served model's name")
    top: list[TopClass] = Field(description="most probable first")
    attention: AttentionMap | None = Field(None, description="the attention rollout, with ?attention=1")


class Neighbour(BaseModel):
    id: str = Field(description="the indexed image's id (its path when indexed from files)")
    score: float = Field(ge=-1, le=1, description="cosine similarity")


class SearchAnswer(BaseModel):
    model: str = Field(description="the served model's name")
    neighbours: list[Neighbour] = Field(description="most similar first")


class HealthAnswer(BaseModel):
    status: str = Field(description='"ok"')
    queue_depth: int = Field(ge=0, description="requests waiting for the model")


FORMATS_TEXT = "JPEG, PNG, BMP, GIF, TIFF, WebP or PPM/PGM/PBM"  # IMAGE_FORMATS, in words
BINARY = {
    "type": "string",
    "format": "binary",
    "minLength": 1,  # an empty body or file is refused (400)
    "description": f"the bytes of a {FORMATS_TEXT} file; anything else (another format, a truncated file) is "
    "answered 400, a larger image than the server allows 413",
}
PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "description": f"the image, a {FORMATS_TEXT} file (other formats, however they are labelled, are answered "
        "400): raw bytes (image/*, application/octet-stream) or a multipart upload whose first file is the image",
        "content": {
            "image/*": {"schema": BINARY},
            "application/octet-stream": {"schema": BINARY},
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": BINARY}, "required": ["file"]},
                "encoding": {"file": {"contentType": "image/*"}},
            },
        },
    }
}


def error_doc(description: str, retry: bool = False) -> dict[str, Any]:
    """An error response in the OpenAPI schema: the app's ``{"detail": ...}`` (with ``retry``: and Retry-After)."""
    doc: dict[str, Any] = {"model": ErrorBody, "description": description}
    if retry:
        doc["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    return doc


PREDICT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: error_doc(
        f"empty body, a file that is not a {FORMATS_TEXT} image (whatever its Content-Type says), an undecodable "
        "or truncated image, a multipart upload without a file"
    ),
    413: error_doc("upload or image (pixels) over the limit, or an image the preprocessing refuses"),
    415: error_doc("content type other than image/*, application/octet-stream, multipart/form-data"),
    422: error_doc("a query parameter out of range or of the wrong type"),
    503: error_doc("queue full or shutting down (retry later)", retry=True),
    504: error_doc("not answered within the request timeout"),
}

SEARCH_ID_ERRORS: dict[int | str, dict[str, Any]] = {
    404: error_doc("the id is not in the index"),
    422: error_doc("a query parameter missing, out of range or of the wrong type"),
}
