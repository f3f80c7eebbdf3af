"""The demo's "Similar images" tab (``vitkit demo CKPT --index INDEX``): the neighbours it shows are those
``vitkit search`` answers for the same image, in the same order, as thumbnails of the indexed photos.

The index is built by ``vitkit index`` over a folder of real photos (scikit-learn's two, with crops, flips and a
resized copy of each). The browser test runs the real command in a subprocess and drives Debian's chromium with
Playwright (skipped where chromium is not installed, as ``test_demo_browser.py``); the tab's computations are also
tested without a browser. Queries are PNGs: ``vitkit search`` decodes a JPEG query at a reduced scale where the
model's input is small (as ``vitkit predict`` does), the page at full size, so a JPEG query would compare two decodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from serve_helpers import chromium_page, free_port, make_checkpoint, vitkit_server

from vitkit.cli import main

K = 8  # the tab's default number of neighbours


def variants(name: str) -> dict[str, Image.Image]:
    from sklearn.datasets import load_sample_image

    img = Image.fromarray(load_sample_image(name))
    w, h = img.size
    stem = name.split(".")[0]
    return {
        f"{stem}.jpg": img,
        f"{stem}_flip.jpg": img.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
        f"{stem}_crop.jpg": img.crop((w // 10, h // 10, w, h)),
        f"{stem}_corner.jpg": img.crop((0, 0, w // 2, h // 2)),
        f"{stem}_small.png": img.resize((w // 3, h // 3)),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("similar_demo")
    ckpt = make_checkpoint(root / "tiny")
    photos = root / "photos"
    photos.mkdir()
    for name in ("china.jpg", "flower.jpg"):
        for file, img in variants(name).items():
            img.save(photos / file, quality=90)
    outside = root / "outside.jpg"
    variants("china.jpg")["china.jpg"].rotate(90, expand=True).save(outside, quality=90)
    (photos / "link.jpg").symlink_to(outside)  # indexed, but a link out of the folder: no thumbnail
    index = root / "photos.index"
    # fp32 vectors: the served model embeds its queries in fp32 (auto would be bf16 on CPUs with native bf16)
    assert main(["index", str(photos), "-c", str(ckpt), "--out", str(index), "--exact", "--precision", "fp32"]) == 0
    query = root / "query.png"
    img = variants("flower.jpg")["flower.jpg"]
    img.crop((30, 20, img.width - 50, img.height - 10)).save(query)  # not indexed: a crop of an indexed photo
    return {"root": root, "ckpt": ckpt, "photos": photos, "index": index, "query": query, "link": photos / "link.jpg"}


def search_cli(index: Path, query: str, out: Path) -> list[dict]:
    assert main(["search", str(index), query, "--top-k", str(K), "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    return row["neighbours"]


def test_the_tab_answers_what_vitkit_search_answers(
    built: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("gradio")
    from vitkit.serve.demo import SimilarView, build_demo
    from vitkit.serve.served_model import ServedModel
    from vitkit.serve.similar import THUMBNAIL_PX, SimilarImages

    served = ServedModel.from_checkpoint(built["ckpt"], fast=False)
    similar = SimilarImages.open(built["index"], served)
    view = SimilarView(served, similar, tmp_path)
    want = search_cli(built["index"], str(built["query"]), tmp_path / "q.jsonl")
    shown, state, verdict = view.query({"path": str(built["query"]), "orig_name": "query.png"}, None)
    assert verdict == "**Query:** query.png" and max(shown.size) <= THUMBNAIL_PX
    gallery, table = view.neighbours(state, K)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [r[1].strip("`") for r in rows] == [n["id"] for n in want]
    assert [float(r[2].rstrip(" |")) for r in rows] == pytest.approx([n["score"] for n in want], abs=1e-5)
    assert len(gallery) == K and all(Path(p).parent == tmp_path / "thumbnails" for p, _ in gallery)
    # by id: vitkit search's id: query, the image itself left out
    link = str(built["link"])
    want_id = search_cli(built["index"], f"id:{want[0]['id']}", tmp_path / "i.jsonl")
    _, state, verdict = view.query(None, want[0]["id"])
    assert [r.split(" | ")[1].strip("`") for r in view.neighbours(state, K)[1].splitlines()[2:]] == [
        n["id"] for n in want_id
    ]
    with caplog.at_level("WARNING", logger="vitkit.serve.demo"):
        assert view.thumbnail_file(link) is None  # indexed, but a link out of the folder
    assert any(link in r.getMessage() for r in caplog.records)
    assert view.query(None, "nowhere.jpg")[2] == "**Not in the index:** nowhere.jpg"
    for path, _ in gallery:
        assert max(Image.open(path).size) <= THUMBNAIL_PX
    # the tab is there with an index only
    tabs = lambda demo: [getattr(b, "label", None) for b in demo.blocks.values() if type(b).__name__ == "Tab"]  # noqa: E731
    assert tabs(build_demo(served, tmp_path / "with", similar=similar)) == ["Predictions", "Similar images"]
    assert tabs(build_demo(served, tmp_path / "without")) == []


@pytest.fixture
def demo_url(built: dict[str, Path]) -> Iterator[str]:
    with vitkit_server(["demo", str(built["ckpt"]), "--index", str(built["index"])], ready="/") as (url, _):
        yield url


@pytest.mark.slow
def test_similar_images_tab_in_headless_chromium(demo_url: str, built: dict[str, Path], tmp_path: Path) -> None:
    from vitkit.serve.similar import THUMBNAIL_PX

    want = search_cli(built["index"], str(built["query"]), tmp_path / "q.jsonl")
    with chromium_page(tmp_path / "profile") as (sync_api, page):
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(demo_url, wait_until="domcontentloaded", timeout=60_000)
        page.get_by_role("tab", name="Similar images").click()
        page.locator("#similar-input input[type=file]").set_input_files(str(built["query"]))
        sync_api.expect(page.locator("#similar-verdict")).to_contain_text("Query: query.png", timeout=60_000)
        rows = page.locator("#neighbour-table tbody tr")
        sync_api.expect(rows).to_have_count(K, timeout=30_000)
        cells = [[c.strip() for c in rows.nth(i).locator("td").all_inner_texts()] for i in range(K)]
        assert [c[1] for c in cells] == [n["id"] for n in want]
        assert [float(c[2]) for c in cells] == pytest.approx([n["score"] for n in want], abs=1e-5)
        thumbs = page.locator("#neighbours img")
        sync_api.expect(thumbs).to_have_count(K, timeout=30_000)
        for i in range(K):
            img = thumbs.nth(i)
            img.scroll_into_view_if_needed()
            page.wait_for_function("e => e.complete && e.naturalWidth > 0", arg=img.element_handle())
            w, h = img.evaluate("e => [e.naturalWidth, e.naturalHeight]")
            assert 0 < max(w, h) <= THUMBNAIL_PX, (i, w, h)  # a thumbnail, not the photo
        captions = page.locator("#neighbours").inner_text()
        for n in want:
            assert Path(n["id"]).name in captions
        query = page.locator("#similar-query img").first
        sync_api.expect(query).to_be_visible(timeout=30_000)
    assert all(u.startswith(demo_url) or u.startswith(("data:", "blob:")) for u in requests), requests
    assert not any(str(built["photos"]) in u for u in requests)  # thumbnails from the page's folder, never the photos


def test_demo_refuses_a_folder_that_is_not_an_index(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vitkit demo --index`` on a folder that is not an index: one line naming it, exit 2, before the page
    starts; the folder is left as it was."""
    pytest.importorskip("gradio")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "manifest.json").write_text("{}\n")
    capsys.readouterr()
    assert main(["demo", str(built["ckpt"]), "--index", str(planted), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(planted) in err[0], err
    assert [p.name for p in planted.iterdir()] == ["manifest.json"]
