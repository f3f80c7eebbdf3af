"""``vitkit serve``'s HTTP API in-process (FastAPI's TestClient runs the app and its lifespan, batcher
included): every endpoint, every bad input, and the labels ``vitkit predict`` gives for the same images."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from serve_helpers import CLASSES, image_bytes, make_checkpoint, metric, png_header_bomb

from helpers import FIXTURES
from vitkit.analysis.attention_maps import rollout_maps, upsample_maps
from vitkit.cli import main
from vitkit.serve.app import create_app
from vitkit.serve.served_model import ServedModel
from vitkit.serve.server import ServeOptions

OFFICIAL = FIXTURES / "official_vit_tiny.npz"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def client(ckpt: Path) -> Iterator[TestClient]:
    served = ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=4)
    opts = ServeOptions(max_batch=4, max_wait_ms=2, max_upload_bytes=64 << 10, max_pixels=1_000_000)
    with TestClient(create_app(served, opts)) as c:
        yield c


def predict_cli(capsys: pytest.CaptureFixture[str], ckpt: Path, paths: list[Path], k: int) -> list[dict]:
    capsys.readouterr()
    # the reference, as served at fp32 (predict's default decodes JPEGs at reduced scale)
    assert main(["predict", "-c", str(ckpt), "--precision", "fp32", "--json", "--top-k", str(k), *map(str, paths)]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("which", ["vitkit-folder", "official-npz"])
def test_served_labels_equal_vitkit_predict(
    which: str, ckpt: Path, tmp_path: Path, sample_jpeg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ckpt if which == "vitkit-folder" else OFFICIAL
    served = ServedModel.from_checkpoint(path, precision="fp32", max_batch=4)
    files = [sample_jpeg]
    for seed, fmt in [(1, "PNG"), (2, "JPEG"), (3, "WEBP"), (4, "BMP")]:
        files.append(tmp_path / f"img{seed}.{fmt.lower()}")
        files[-1].write_bytes(image_bytes(seed, (50 + 7 * seed, 40), fmt))
    k = 3
    expected = predict_cli(capsys, path, files, k)
    with TestClient(create_app(served, ServeOptions(max_batch=4))) as c:
        for i, (f, want) in enumerate(zip(files, expected, strict=True)):
            if i % 2:  # both upload styles
                r = c.post(f"/predict?top_k={k}", content=f.read_bytes(), headers={"content-type": "image/x"})
            else:
                r = c.post(f"/predict?top_k={k}", files={"file": (f.name, f.read_bytes(), "image/x")})
            assert r.status_code == 200, r.text
            got = r.json()["top"]
            assert [t["label"] for t in got] == [t["label"] for t in want["top"]]
            np.testing.assert_allclose([t["prob"] for t in got], [t["prob"] for t in want["top"]], atol=1e-5)
    if which == "vitkit-folder":
        assert {t["label"] for t in got} <= set(CLASSES)


def test_predict_json_shape_and_attention(client: TestClient, ckpt: Path) -> None:
    data = image_bytes(7, (48, 32))
    r = client.post("/predict?attention=1&top_k=6", content=data, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    doc = r.json()
    probs = [t["prob"] for t in doc["top"]]
    assert len(probs) == 6 and probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1, abs=1e-5)
    assert [t["label"] for t in doc["top"]] == [CLASSES[t["index"]] for t in doc["top"]]
    png = Image.open(io.BytesIO(base64.b64decode(doc["attention"]["rollout_png"])))
    assert png.mode == "L" and png.size == (48, 32) and doc["attention"]["size"] == [32, 48]
    # the map is this image's rollout (Abnar & Zuidema via vitkit.analysis on the fp32 model)
    served = ServedModel.from_checkpoint(ckpt, precision="fp32")
    x = served.to_tensor(Image.open(io.BytesIO(data)))[None]
    out = served.model.forward_intermediates(x)
    want = upsample_maps(rollout_maps(out.attentions, (4, 6), 1), (32, 48))[0].detach().numpy()
    np.testing.assert_allclose(np.asarray(png, dtype=np.float64) / 255, want, atol=1 / 255 + 1e-6)
    assert "attention" not in client.post("/predict", content=data).json()  # only when asked


def test_health_model_card_openapi(client: TestClient, ckpt: Path) -> None:
    assert client.get("/health").json()["status"] == "ok"
    card = client.get("/model").json()
    assert card["classes"] == CLASSES and card["num_classes"] == 6 and card["image_size"] == [32, 48]
    assert card["preprocessing"]["resize"] == "crop" and card["preprocessing"]["mean"] == [0.5, 0.4, 0.3]
    assert card["precision"] == "fp32" and card["serving"]["max_batch"] == 4
    assert card["serving"]["header_timeout_s"] == 10.0 and card["serving"]["decoders"] >= 1
    spec = client.get("/openapi.json").json()
    predict = spec["paths"]["/predict"]["post"]
    body = predict["requestBody"]["content"]
    assert {"image/*", "application/octet-stream", "multipart/form-data"} <= set(body)
    # a schema-driven client learns which image files are taken, and that others are a 400
    assert "JPEG, PNG, BMP, GIF, TIFF, WebP" in predict["requestBody"]["description"]
    assert "answered 400" in body["image/*"]["schema"]["description"]
    assert "WebP" in predict["responses"]["400"]["description"]
    assert {"/health", "/metrics", "/model"} <= set(spec["paths"])
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    if "/docs-assets/" in docs.text:  # served from the installed bundle: works without internet access
        js = client.get("/docs-assets/swagger-ui-bundle.js")
        assert js.status_code == 200 and len(js.content) > 100_000


def flat_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(buf, format="PNG")
    return buf.getvalue()


def bad_requests() -> list[tuple[str, dict, int, str]]:
    """(name, request kwargs, expected status, words in the message)."""
    real = image_bytes(1)
    mp_empty = {"content": b"--xx\r\n\r\n--xx--\r\n", "headers": {"content-type": "multipart/form-data; boundary=xx"}}
    return [
        ("empty raw body", {"content": b"", "headers": {"content-type": "image/png"}}, 400, "empty"),
        ("empty multipart file", {"files": {"file": ("a.png", b"", "image/png")}}, 400, "empty"),
        ("not an image", {"content": b"hello world" * 10, "headers": {"content-type": "image/png"}}, 400, "recognised"),
        ("truncated png", {"content": real[: len(real) // 2], "headers": {"content-type": "image/png"}}, 400, "trunc"),
        ("json body", {"json": {"image": "x"}}, 415, "content-type application/json"),
        ("text body", {"content": b"abc", "headers": {"content-type": "text/plain"}}, 415, "not accepted"),
        ("form fields only", {"data": {"a": "b"}}, 415, "x-www-form-urlencoded"),
        ("multipart without file", {"files": {"x": (None, "just text")}}, 400, "no file"),
        ("malformed multipart", mp_empty, 400, "multipart"),
        ("upload over limit", {"content": b"\0" * (65 << 10), "headers": {"content-type": "image/png"}}, 413, "limit"),
        ("streamed upload over limit", {"content": iter([b"\0" * (32 << 10)] * 3)}, 413, "limit"),
        ("decompression bomb", {"content": png_header_bomb(100_000, 100_000)}, 413, "10000000000 pixels"),
        ("over max pixels", {"content": flat_png(1100, 1000)}, 413, "1100x1000 = 1100000 pixels exceeds"),
        ("bad top_k", {"content": real, "params": {"top_k": 0}}, 422, "top_k"),
        ("bad attention flag", {"content": real, "params": {"attention": "maybe"}}, 422, "attention"),
        ("line of pixels", {"content": flat_png(30000, 1)}, 413, "aspect ratio of 30000:1"),  # centre crop
    ]


@pytest.mark.parametrize(("name", "kwargs", "status", "words"), bad_requests(), ids=[b[0] for b in bad_requests()])
def test_bad_input_is_a_clear_4xx(client: TestClient, name: str, kwargs: dict, status: int, words: str) -> None:
    r = client.post("/predict", **kwargs)
    assert r.status_code == status, r.text
    assert words.lower() in r.json()["detail"].lower()


def test_server_survives_bad_input_and_counts_it(client: TestClient) -> None:
    for _, kwargs, _, _ in bad_requests():
        client.post("/predict", **kwargs)
    assert client.get("/predict").status_code == 405 and client.get("/nope").json()["detail"] == "Not Found"
    assert client.get("/health").status_code == 200
    assert client.post("/predict", content=image_bytes(3)).status_code == 200
    text = client.get("/metrics").text
    for status in ("200", "400", "413", "415", "422"):
        assert metric(text, "vitkit_requests_total", path="/predict", status=status) >= 1, status
    assert metric(text, "vitkit_requests_total", path="other", status="404") >= 1
    assert not any('status="5' in line for line in text.splitlines())  # never a server error
    assert metric(text, "vitkit_request_latency_seconds_count", path="/predict") >= 10
    assert metric(text, "vitkit_batch_size_count") >= 1 and metric(text, "vitkit_batch_size_sum") >= 1
    assert "vitkit_queue_depth 0.0" in text
    assert text.startswith("# HELP") and "vitkit_batch_size_bucket" in text


def test_served_precisions_agree_on_labels(ckpt: Path) -> None:
    """bf16 / int8 fast paths answer (where this CPU has them) with the fp32 model's top label on most images."""
    from vitkit.inference.fast import has_onednn_int8

    x = torch.stack([ServedModel.from_checkpoint(ckpt, precision="fp32").to_tensor(
        Image.open(io.BytesIO(image_bytes(s)))) for s in range(16)])  # fmt: skip
    ref = ServedModel.from_checkpoint(ckpt, precision="fp32").probabilities(x).argmax(-1)
    for precision in ["bf16"] + (["int8"] if has_onednn_int8() else []):
        served = ServedModel.from_checkpoint(ckpt, precision=precision)
        assert served.precision == precision
        agree = (served.probabilities(x).argmax(-1) == ref).float().mean().item()
        assert agree >= 0.8, (precision, agree)


def test_missing_extra_says_how_to_install() -> None:
    from vitkit.commands.serve import require_extra
    from vitkit.errors import VitkitError

    with pytest.raises(VitkitError, match=r"not_a_module_xyz.*pip install 'vitkit\[serve\]'"):
        require_extra("fastapi", "not_a_module_xyz")


# ---- the OpenAPI schema describes what the server sends (issue 25, item 13) -------------------------------------


def declared(spec: dict, path: str, method: str, status: int, content_type: str) -> dict:
    """The schema the OpenAPI document declares for this answer (asserting that it declares the status and the
    media type), with the document's components so that its $refs resolve."""
    responses = spec["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path}: {status} is not declared ({sorted(responses)})"
    content = responses[str(status)].get("content", {})
    media = content_type.split(";")[0].strip()
    assert media in content, f"{method.upper()} {path} {status}: {media} is not declared ({sorted(content)})"
    return {**content[media].get("schema", {}), "components": spec.get("components", {})}


def assert_conforms(spec: dict, method: str, path: str, r: Any) -> None:
    import jsonschema

    schema = declared(spec, path, method, r.status_code, r.headers["content-type"])
    body = r.json() if r.headers["content-type"].startswith("application/json") else r.text
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def test_every_answer_is_declared_in_the_schema(client: TestClient) -> None:
    """Each answer's status, content type and body are those /openapi.json declares: the error model of a 422
    (FastAPI's default declares a list of validation errors), /metrics as Prometheus text, every 4xx."""
    spec = client.get("/openapi.json").json()
    ok = client.post("/predict?attention=1", content=image_bytes(2, (48, 32)))
    assert ok.status_code == 200
    assert_conforms(spec, "post", "/predict", ok)
    for _, kwargs, status, _ in bad_requests():
        r = client.post("/predict", **kwargs)
        assert r.status_code == status
        assert_conforms(spec, "post", "/predict", r)
    for path in ("/health", "/model", "/metrics"):
        assert_conforms(spec, "get", path, client.get(path))
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_health_503_is_declared(ckpt: Path) -> None:
    """/health while the model worker is not running (no lifespan: the batcher never started) is a declared 503."""
    app = create_app(ServedModel.from_checkpoint(ckpt, precision="fp32"), ServeOptions())
    c = TestClient(app)  # not entered: no lifespan
    r = c.get("/health")
    assert r.status_code == 503 and "not serving" in r.json()["detail"]
    assert_conforms(c.get("/openapi.json").json(), "get", "/health", r)
    r = c.post("/predict", content=image_bytes(1))  # refused before the upload is read, never a 500
    assert r.status_code == 503 and "not serving" in r.json()["detail"]
    assert_conforms(c.get("/openapi.json").json(), "post", "/predict", r)


def test_the_schema_refuses_what_the_server_refuses(client: TestClient) -> None:
    """An empty file or body is invalid by the schema (the server answers 400), a multipart part is declared an
    image, and query parameters carry their bounds: a generated client cannot build a request the schema calls
    valid and the server refuses for its shape."""
    import jsonschema

    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/predict"]["post"]
    content = op["requestBody"]["content"]
    for media in ("image/*", "application/octet-stream", "multipart/form-data"):
        schema = content[media]["schema"]
        value: Any = {"file": ""} if media == "multipart/form-data" else ""
        assert not jsonschema.Draft202012Validator(schema).is_valid(value), media
        assert jsonschema.Draft202012Validator(schema).is_valid({"file": "x"} if media.startswith("multi") else "x")
    assert content["multipart/form-data"]["encoding"]["file"]["contentType"] == "image/*"
    top_k = next(p for p in op["parameters"] if p["name"] == "top_k")["schema"]
    assert (top_k["minimum"], top_k["maximum"]) == (1, 1000)
    assert "HTTPValidationError" not in json.dumps(spec)  # FastAPI's list-shaped 422 body is never sent


def test_a_server_error_answers_a_fixed_message_and_logs_the_detail(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception (here one carrying a server path): 500 with "internal error" alone; the
    exception's text and traceback go to the log, never to the client."""
    served = ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=4)

    def broken(img: Any) -> torch.Tensor:
        raise RuntimeError("secret detail at /srv/private/weights")

    monkeypatch.setattr(served, "to_tensor", broken)
    app = create_app(served, ServeOptions(max_batch=4))
    with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level("ERROR", logger="vitkit.serve"):
        res = c.post("/predict", content=image_bytes(1))
    assert res.status_code == 500 and res.json() == {"detail": "internal error"}
    assert "secret detail at /srv/private/weights" in caplog.text
