"""``GET /thumbnail?id=`` of ``vitkit serve --index``: a small JPEG of an indexed image and nothing else on disk.

The index here holds real files (scikit-learn's photos) under ``photos/`` and, planted beside them, ids that must
not be served although they are in the index: a link out of the folder, a path through ``..`` to a photo outside,
a file deleted since. Ids not in the index (absolute paths among them) are 404 whatever exists on disk. A served
thumbnail is the indexed photo, decoded and re-encoded at most ``THUMBNAIL_PX`` a side (compared with Pillow's own
reduction of the file), never the file's bytes; a bomb is refused by the server's pixel limit."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from serve_helpers import make_checkpoint, png_header_bomb

from vitkit.search.index import Index
from vitkit.serve.app import create_app
from vitkit.serve.served_model import ServedModel
from vitkit.serve.server import ServeOptions
from vitkit.serve.similar import THUMBNAIL_PX, SimilarImages, indexed_folder


def photo(name: str) -> Image.Image:
    from sklearn.datasets import load_sample_image

    return Image.fromarray(load_sample_image(name))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files on disk, by role; the ids are their paths as ``vitkit index`` records them (absolute here)."""
    root = tmp_path_factory.mktemp("thumbs")
    photos, outside = root / "photos", root / "outside"
    (photos / "sub").mkdir(parents=True)
    outside.mkdir()
    photo("china.jpg").save(photos / "china.jpg", quality=90)  # 640x427
    photo("flower.jpg").transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(photos / "sub" / "flower.png")
    photo("flower.jpg").save(outside / "secret.jpg", quality=90)
    (photos / "out.jpg").symlink_to(outside / "secret.jpg")  # a planted link out of the folder
    (photos / "in.jpg").symlink_to(photos / "china.jpg")  # a link inside it
    (photos / "notes.jpg").write_text("not an image\n")
    (photos / "bomb.png").write_bytes(png_header_bomb(2_000, 2_000))
    (photos / "gone.jpg").write_bytes((photos / "china.jpg").read_bytes())
    files = {
        "china": photos / "china.jpg",
        "flower": photos / "sub" / "flower.png",
        "out": photos / "out.jpg",
        "in": photos / "in.jpg",
        "dotdot": photos / "sub" / ".." / ".." / "outside" / "secret.jpg",
        "notes": photos / "notes.jpg",
        "bomb": photos / "bomb.png",
        "gone": photos / "gone.jpg",
    }
    return {"root": str(root), **{k: str(v) for k, v in files.items()}}


@pytest.fixture(scope="module")
def client(tree: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    ids = [v for k, v in tree.items() if k != "root"]
    rng = np.random.default_rng(0)
    index = Index.build(ids, rng.normal(size=(len(ids), 8)).astype(np.float32))
    Path(tree["gone"]).unlink()  # deleted after it was indexed
    served = ServedModel.from_checkpoint(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"), precision="fp32")
    similar = SimilarImages(index, "thumbs.index", None, None, indexed_folder(index.ids, os.getcwd()))
    assert similar.root == str(Path(tree["root"]) / "photos")  # the ``..`` id does not widen it
    opts = ServeOptions(max_batch=2, max_pixels=1_000_000, max_decoding=2)
    with TestClient(create_app(served, opts, similar)) as c:
        yield c


def get(client: TestClient, id: str) -> tuple[int, bytes, str]:
    r = client.get("/thumbnail", params={"id": id})
    return r.status_code, r.content, r.headers.get("content-type", "")


def test_a_thumbnail_is_the_indexed_image_made_small(client: TestClient, tree: dict[str, str]) -> None:
    for key in ("china", "flower", "in"):
        status, body, ctype = get(client, tree[key])
        assert status == 200 and ctype == "image/jpeg", (key, body[:200])
        thumb = Image.open(io.BytesIO(body))
        assert thumb.format == "JPEG" and max(thumb.size) == THUMBNAIL_PX, (key, thumb.size)
        assert body != Path(tree[key]).read_bytes()
        want = Image.open(tree[key]).convert("RGB")
        want.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        assert thumb.size == want.size
        err = np.abs(np.asarray(thumb, dtype=np.float32) - np.asarray(want, dtype=np.float32)).mean()
        assert err < 6, (key, err)  # the same picture, up to resampling and JPEG (another photo: about 60)
    china = np.asarray(Image.open(io.BytesIO(get(client, tree["china"])[1])), dtype=np.float32)
    flower = Image.open(io.BytesIO(get(client, tree["flower"])[1])).resize((china.shape[1], china.shape[0]))
    assert np.abs(china - np.asarray(flower, dtype=np.float32)).mean() > 30


def test_nothing_outside_the_indexed_folder_is_served(client: TestClient, tree: dict[str, str]) -> None:
    refused = {
        "out": tree["out"],  # in the index: a link out of the folder
        "dotdot": tree["dotdot"],  # in the index: a path through ..
        "gone": tree["gone"],  # in the index: no file any more
        "absolute": str(Path(tree["root"]) / "outside" / "secret.jpg"),  # the real file, not an id
        "normalised": os.path.normpath(tree["dotdot"]),
        "relative": "photos/china.jpg",
        "dots": tree["china"].replace("/photos/", "/photos/sub/../"),
        "unknown": "nowhere.jpg",
        "system": "/etc/passwd",
    }
    for key, id in refused.items():
        r = client.get("/thumbnail", params={"id": id})
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", (key, r.status_code)
        detail = r.json()["detail"]
        assert "secret" not in detail and tree["root"] not in detail, detail
    assert client.get("/thumbnail").status_code == 422
    assert client.get("/thumbnail", params={"id": ""}).status_code == 422


def test_a_bomb_or_a_file_that_is_not_an_image_is_refused(client: TestClient, tree: dict[str, str]) -> None:
    status, body, _ = get(client, tree["bomb"])
    assert status == 413 and b"exceeds the limit of 1000000 pixels" in body, body
    status, body, _ = get(client, tree["notes"])
    assert status == 422 and b"not a recognised image file" in body, body
    assert client.get("/health").json()["status"] == "ok"


def test_the_thumbnail_endpoint_is_in_the_schema_only_with_an_index(
    client: TestClient, tree: dict[str, str], tmp_path: Path
) -> None:
    doc = client.get("/openapi.json").json()["paths"]["/thumbnail"]["get"]
    assert "image/jpeg" in doc["responses"]["200"]["content"]
    assert {"404", "413", "422"} <= set(doc["responses"])
    served = ServedModel.from_checkpoint(make_checkpoint(tmp_path / "tiny"), precision="fp32", max_batch=2)
    with TestClient(create_app(served, ServeOptions(max_batch=2))) as c:
        assert c.get("/thumbnail", params={"id": tree["china"]}).status_code == 404
        assert "/thumbnail" not in c.get("/openapi.json").json()["paths"]


def test_relative_ids_are_taken_from_the_folder_the_server_started_in(
    tree: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vitkit.serve.similar import NotServed

    monkeypatch.chdir(tree["root"])
    ids = ["photos/china.jpg", "photos/sub/flower.png", "photos/out.jpg", "photos/../outside/secret.jpg"]
    index = Index.build(ids, np.eye(4, 8, dtype=np.float32))
    similar = SimilarImages(index, "rel.index", None, None, indexed_folder(index.ids, os.getcwd()))
    assert similar.root == str(Path(tree["root"]) / "photos")
    monkeypatch.chdir(tmp_path)  # later changes of the current folder change nothing
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "china.jpg").write_bytes(b"another file")
    assert similar.image_file("photos/china.jpg") == os.path.realpath(tree["china"])
    for id in ids[2:]:
        with pytest.raises(NotServed):
            similar.image_file(id)


def test_a_method_not_allowed_lists_every_method_of_the_path(client: TestClient) -> None:
    """/search has two routes (POST, GET): a 405 names both, as the schema lists both (schemathesis' ST205)."""
    r = client.request("PUT", "/search")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
    r = client.post("/thumbnail", params={"id": "x"})
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_a_large_jpeg_is_made_small_in_the_decoding_process(tmp_path: Path) -> None:
    """A thumbnail of a 4096x3072 JPEG: decoded at 1/8 scale (libjpeg's DCT scaling, 512x384, not 12.6 MP), made
    small in the worker process, so only the thumbnail crosses the pipe; the same picture as Pillow's full decode
    made small. A PNG has no reduced decode: it is decoded whole and made small all the same."""
    from sklearn.datasets import load_sample_image

    from vitkit.images import decode_image
    from vitkit.serve.decoding import DecoderPool, Decoding

    big = Image.fromarray(load_sample_image("china.jpg")).resize((4096, 3072), Image.Resampling.BICUBIC)
    jpeg, png = io.BytesIO(), io.BytesIO()
    big.save(jpeg, format="JPEG", quality=90)
    big.resize((1024, 768)).save(png, format="PNG")
    assert decode_image(jpeg.getvalue(), "big", draft=(THUMBNAIL_PX, THUMBNAIL_PX)).size == (512, 384)
    assert decode_image(png.getvalue(), "big", draft=(THUMBNAIL_PX, THUMBNAIL_PX)).size == (1024, 768)
    pool = DecoderPool(20_000_000, 10.0, "RGB")
    try:
        for data in (jpeg.getvalue(), png.getvalue()):
            thumb = pool.decode(data, Decoding(), THUMBNAIL_PX)
            want = Image.open(io.BytesIO(data)).convert("RGB")
            want.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX), Image.Resampling.BICUBIC)
            assert thumb.size == want.size == (THUMBNAIL_PX, 192)
            err = np.abs(np.asarray(thumb, dtype=np.float32) - np.asarray(want, dtype=np.float32)).mean()
            assert err < 3, err
        assert pool.decode(png.getvalue(), Decoding()).size == (1024, 768)  # 0: the image itself
    finally:
        pool.close()
