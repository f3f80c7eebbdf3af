"""``vitkit serve --index``: ``POST /search`` and ``GET /search?id=`` answer what ``vitkit search`` answers for the
same images and ids (the index built by ``vitkit index`` from the same checkpoint), uploads are bounded as
``/predict``'s are, and an index made by another checkpoint is refused at start-up in one line."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from serve_helpers import image_bytes, make_checkpoint

from helpers import randomize_
from vitkit.checkpoints import load_checkpoint
from vitkit.checkpoints.vitkit_format import save
from vitkit.cli import main
from vitkit.errors import DataError
from vitkit.serve.app import create_app
from vitkit.serve.served_model import ServedModel
from vitkit.serve.server import ServeOptions
from vitkit.serve.similar import SimilarImages


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("serve_search")
    ckpt = make_checkpoint(root / "tiny")
    images = root / "images"
    images.mkdir()
    for seed in range(12):
        fmt = "PNG" if seed % 2 else "JPEG"
        (images / f"img{seed:02d}.{fmt.lower()}").write_bytes(image_bytes(seed, (40 + 3 * seed, 36), fmt))
    index = root / "index"
    # fp32 vectors: the served model embeds its queries in fp32 (auto would be bf16 on CPUs with native bf16)
    assert main(["index", str(images), "-c", str(ckpt), "--out", str(index), "--exact", "--precision", "fp32"]) == 0
    return ckpt, images, index


@pytest.fixture(scope="module")
def client(setup: tuple[Path, Path, Path]) -> Iterator[TestClient]:
    ckpt, _, index = setup
    served = ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=4)
    opts = ServeOptions(max_batch=4, max_wait_ms=2, max_upload_bytes=64 << 10, max_pixels=1_000_000)
    with TestClient(create_app(served, opts, SimilarImages.open(index, served))) as c:
        yield c


def search_cli(index: Path, queries: list[str], k: int, out: Path) -> list[dict]:
    assert main(["search", str(index), *queries, "--top-k", str(k), "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_search_by_image_equals_vitkit_search(
    client: TestClient, setup: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, images, index = setup
    queries = [tmp_path / "q1.png", tmp_path / "q2.jpeg", images / "img03.png"]
    queries[0].write_bytes(image_bytes(101, (50, 44), "PNG"))
    queries[1].write_bytes(image_bytes(102, (33, 61), "JPEG"))
    expected = search_cli(index, [str(q) for q in queries], 5, tmp_path / "r.jsonl")
    for q, want in zip(queries, expected, strict=True):
        r = client.post("/search?top_k=5", content=q.read_bytes(), headers={"Content-Type": "image/*"})
        assert r.status_code == 200, r.text
        got = r.json()["neighbours"]
        assert [n["id"] for n in got] == [n["id"] for n in want["neighbours"]]
        assert [n["score"] for n in got] == pytest.approx([n["score"] for n in want["neighbours"]], abs=1e-5)
    # an indexed image finds itself first, at cosine 1
    assert got[0]["id"].endswith("img03.png") and got[0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_search_by_id_equals_vitkit_search(client: TestClient, setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, images, index = setup
    ids = [str(p) for p in sorted(images.iterdir())[:3]]
    rows = search_cli(index, [f"id:{i}" for i in ids], 4, tmp_path / "ids.jsonl")
    for i, want in zip(ids, rows, strict=True):
        r = client.get("/search", params={"id": i, "top_k": 4})
        assert r.status_code == 200, r.text
        got = r.json()["neighbours"]
        assert [n["id"] for n in got] == [n["id"] for n in want["neighbours"]]
        # one query here, three in one matrix product there: the BLAS may round the 6th decimal differently
        assert [n["score"] for n in got] == pytest.approx([n["score"] for n in want["neighbours"]], abs=2e-6)
        assert i not in [n["id"] for n in got]
    missing = client.get("/search", params={"id": "nowhere.png"})
    assert missing.status_code == 404 and missing.json() == {"detail": "id not in the index"}
    assert client.get("/search").status_code == 422


def test_search_uploads_are_bounded_as_predict(client: TestClient) -> None:
    big = client.post("/search", content=b"\0" * (65 << 10), headers={"Content-Type": "image/png"})
    assert big.status_code == 413
    bad = client.post("/search", content=b"not an image", headers={"Content-Type": "image/png"})
    assert bad.status_code == 400 and "detail" in bad.json()
    assert (
        client.post("/search?top_k=0", content=image_bytes(1), headers={"Content-Type": "image/png"}).status_code == 422
    )
    card = client.get("/model").json()
    assert card["search"]["images"] == 12 and card["search"]["pool"] == "pre-logits"
    assert "/search" in client.get("/openapi.json").json()["paths"]


def test_no_search_route_without_an_index(setup: tuple[Path, Path, Path]) -> None:
    served = ServedModel.from_checkpoint(setup[0], precision="fp32", max_batch=2)
    with TestClient(create_app(served, ServeOptions(max_batch=2))) as c:
        assert c.get("/search", params={"id": "x"}).status_code == 404
        assert "/search" not in c.get("/openapi.json").json()["paths"]


def test_an_index_of_another_checkpoint_is_refused(
    setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _, index = setup
    other = load_checkpoint(ckpt)
    torch.manual_seed(7)
    randomize_(other.model, std=0.2)  # the same architecture and preprocessing, other weights
    other_path = save(other.model, tmp_path / "other", preprocess=other.meta.preprocess,
                      class_names=other.meta.class_names)  # fmt: skip
    with pytest.raises(DataError, match="--index"):
        SimilarImages.open(index, ServedModel.from_checkpoint(other_path, precision="fp32", max_batch=2))
    capsys.readouterr()
    with socket.socket() as s:  # a port free now (the command binds it before loading anything)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(other_path), "--index", str(index), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--index" in err[0] and "checkpoint" in err[0], err


def test_a_folder_that_is_not_an_index_is_refused(
    setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "notes.txt").write_text("buy milk\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capsys.readouterr()
    assert main(["serve", str(setup[0]), "--index", str(planted), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(planted) in err[0], err
    assert (planted / "notes.txt").read_text() == "buy milk\n" and sorted(p.name for p in planted.iterdir()) == [
        "notes.txt"
    ]
