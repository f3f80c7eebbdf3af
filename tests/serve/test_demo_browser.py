"""``vitkit demo`` end to end in a real headless browser: Debian's chromium driven by Playwright.

The demo runs as a subprocess (``python -m vitkit demo``); the browser uploads an image and the test reads
the predicted label (which must be ``vitkit predict``'s top-1 for that image) and checks that the rollout
overlay and the raw attention image are drawn. CI installs chromium (``.ci/run``); elsewhere the test is
skipped when no chromium is installed. The demo's computations are also tested without a browser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_helpers import chromium_page, free_port, make_checkpoint, vitkit_server

from helpers import SRC
from vitkit.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "tiny")


def test_demo_model_predicts_like_vitkit_predict(
    ckpt: Path, sample_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("gradio")
    from vitkit.serve.demo import MEAN_OF_HEADS, DemoModel, build_demo, default_samples
    from vitkit.serve.served_model import ServedModel

    served = ServedModel.from_checkpoint(ckpt, fast=False)
    state = DemoModel(served).analyse(Image.open(sample_jpeg))
    # the demo's exact model against predict's reference (its default decodes JPEGs at reduced scale)
    assert main(["predict", "-c", str(ckpt), "--precision", "fp32", "--json", str(sample_jpeg)]) == 0
    want = json.loads(capsys.readouterr().out)["top"]
    assert list(state["labels"]) == [t["label"] for t in want]
    np.testing.assert_allclose(list(state["labels"].values()), [t["prob"] for t in want], atol=1e-6)
    assert min(state["rollout"].size) >= 32
    views = [DemoModel(served).layer_view(state, layer, head) for layer in (1, 2) for head in (MEAN_OF_HEADS, "head 2")]
    assert len({np.asarray(v).tobytes() for v in views if v is not None}) == 4  # each choice draws its own map
    assert len(default_samples(tmp_path)) == 5
    build_demo(served, tmp_path)  # the page builds for this checkpoint


def test_the_demo_page_prints_no_gradio_banner_and_leaves_the_figure_titles_uncovered(
    ckpt: Path, tmp_path: Path
) -> None:
    """Issue 48: the page printed Gradio's "set `share=True` in `launch()`" (no option of vitkit demo), and the
    label badges of the two model figures covered the titles drawn in them. The command runs in a process of its
    own (its server's threads never write into this test process's captured streams), until the page answers."""
    pytest.importorskip("gradio")
    from vitkit.serve.demo import build_demo
    from vitkit.serve.served_model import ServedModel

    demo = build_demo(ServedModel.from_checkpoint(ckpt, fast=False), tmp_path)
    names = ("Position-embedding similarity", "Patch-embedding filters (PCA)")
    figures = [c for c in demo.blocks.values() if getattr(c, "label", None) in names]
    assert len(figures) == 2
    assert not any(c.show_label for c in figures)  # the figures' own titles say what they show
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "vitkit", "demo", str(ckpt), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import urllib.request

        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None and status is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    status = page.status
            except OSError:
                time.sleep(0.5)
        assert status == 200, "the demo page did not answer"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "share=True" not in out + err and "Running on local URL" not in out + err, out + err
    assert f"127.0.0.1:{port}" in out + err  # the command's own address line


def test_demo_answers_a_file_that_is_not_an_image_in_one_line(
    ckpt: Path, sample_jpeg: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The page's upload handler on Gradio's file record: a text file, a truncated JPEG and an empty file are one
    verdict line naming the file (its name as uploaded, not Gradio's cache path) and one warning in the log; an
    image is classified as ``vitkit predict`` classifies it (the same decoder)."""
    pytest.importorskip("gradio")
    from vitkit.serve.demo import MEAN_OF_HEADS, DemoModel
    from vitkit.serve.served_model import ServedModel

    demo = DemoModel(ServedModel.from_checkpoint(ckpt, fast=False))
    cache = tmp_path / "gradio-cache-8f3a"
    cache.mkdir()
    bad = {"notes.txt": b"shopping list\n", "cut.jpg": sample_jpeg.read_bytes()[:3000], "empty.png": b""}
    words = {"notes.txt": "not a recognised image file", "cut.jpg": "corrupt or truncated", "empty.png": "not a rec"}
    for name, data in bad.items():
        (cache / "upload").write_bytes(data)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vitkit.serve.demo"):
            *outputs, verdict = demo.upload_view({"path": str(cache / "upload"), "orig_name": name}, 2, MEAN_OF_HEADS)
        assert outputs == [None, None, None, None]
        assert verdict.startswith("**Cannot classify this upload:** ") and f"{name}: {words[name]}" in verdict
        assert "\n" not in verdict and str(cache) not in verdict
        assert [r.getMessage() for r in caplog.records] == [f"vitkit demo: upload refused: {verdict.split('** ')[1]}"]
    labels, rollout, raw, state, verdict = demo.upload_view({"path": str(sample_jpeg)}, 2, MEAN_OF_HEADS)
    assert verdict.startswith("**Prediction: ") and rollout is not None and raw is not None
    assert list(labels) == [t["label"] for t in state["top"]]
    assert demo.upload_view(None, 2, MEAN_OF_HEADS) == (None, None, None, None, "")


@pytest.fixture
def demo_url(demo_process: tuple[str, subprocess.Popen[str]]) -> str:
    return demo_process[0]


@pytest.fixture
def demo_process(ckpt: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with vitkit_server(["demo", str(ckpt)], ready="/") as running:
        yield running


@pytest.mark.slow
def test_demo_in_headless_chromium(
    demo_url: str, ckpt: Path, sample_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["predict", "-c", str(ckpt), "--precision", "fp32", "--json", "--top-k", "1", str(sample_jpeg)]) == 0
    label = json.loads(capsys.readouterr().out)["top"][0]["label"]
    with chromium_page(tmp_path / "profile") as (sync_api, page):
        page.goto(demo_url, wait_until="domcontentloaded", timeout=60_000)
        page.locator("#input-image input[type=file]").set_input_files(str(sample_jpeg))
        verdict = page.locator("#verdict")
        sync_api.expect(verdict).to_contain_text(f"Prediction: {label}", timeout=60_000)
        sync_api.expect(page.locator("#top5")).to_contain_text(label)
        for elem in ("#rollout img", "#raw-attention img"):
            img = page.locator(elem).first
            sync_api.expect(img).to_be_visible(timeout=30_000)
            width = img.evaluate("e => e.complete ? e.naturalWidth : 0")
            assert width >= 32, elem  # a decoded picture, not a placeholder


def stop(proc: subprocess.Popen[str]) -> str:
    """Stop the demo and return everything it printed."""
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.mark.slow
def test_demo_in_headless_chromium_refuses_a_non_image_upload(
    demo_process: tuple[str, subprocess.Popen[str]], tmp_path: Path
) -> None:
    """A text file named like a PNG (so the browser's own file-type check lets it through to the server): one line
    on the page, one line in the demo's log, no traceback and no Gradio preprocessing message."""
    url, proc = demo_process
    fake = tmp_path / "holiday.png"
    fake.write_text("these are not the pixels you are looking for\n")
    with chromium_page(tmp_path / "profile") as (sync_api, page):
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        page.locator("#input-image input[type=file]").set_input_files(str(fake))
        verdict = page.locator("#verdict")
        sync_api.expect(verdict).to_contain_text(
            "Cannot classify this upload: holiday.png: not a recognised image file", timeout=60_000
        )
        assert "\n" not in verdict.inner_text().strip()
        assert page.locator(".toast-body").count() == 0  # no Gradio error pop-up
    log = stop(proc)
    assert "Traceback" not in log and "preprocess" not in log, log
    assert [line for line in log.splitlines() if "holiday.png" in line] == [
        "vitkit demo: upload refused: holiday.png: not a recognised image file"
    ], log
