"""``vitkit demo`` end to end in a real headless browser: Debian's chromium driven by Playwright.

The demo runs as a subprocess (``python -m vitkit demo``); the browser uploads an image and the test reads
the predicted label (which must be ``vitkit predict``'s top-1 for that image) and checks that the rollout
overlay and the raw attention image are drawn. CI installs chromium (``.ci/run``); elsewhere the test is
skipped when no chromium is installed. The demo's computations are also tested without a browser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_helpers import free_port, make_checkpoint

from helpers import SRC
from vitkit.cli import main

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "tiny")


def test_demo_model_predicts_like_vitkit_predict(
    ckpt: Path, sample_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("gradio")
    from vitkit.serve.demo import MEAN_OF_HEADS, DemoModel, build_demo, default_samples
    from vitkit.serve.engine import ServedModel

    served = ServedModel.from_checkpoint(ckpt, fast=False)
    state = DemoModel(served).analyse(Image.open(sample_jpeg))
    assert main(["predict", "-c", str(ckpt), "--json", str(sample_jpeg)]) == 0
    want = json.loads(capsys.readouterr().out)["top"]
    assert list(state["labels"]) == [t["label"] for t in want]
    np.testing.assert_allclose(list(state["labels"].values()), [t["prob"] for t in want], atol=1e-6)
    assert min(state["rollout"].size) >= 32
    views = [DemoModel(served).layer_view(state, layer, head) for layer in (1, 2) for head in (MEAN_OF_HEADS, "head 2")]
    assert len({np.asarray(v).tobytes() for v in views if v is not None}) == 4  # each choice draws its own map
    assert len(default_samples(tmp_path)) == 5
    build_demo(served, tmp_path)  # the page builds for this checkpoint


@pytest.fixture
def demo_url(ckpt: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", "demo", str(ckpt), "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"vitkit demo did not start:\n{proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_demo_in_headless_chromium(
    demo_url: str, ckpt: Path, sample_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed on CI (.ci/run installs it with apt-get)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    assert main(["predict", "-c", str(ckpt), "--json", "--top-k", "1", str(sample_jpeg)]) == 0
    label = json.loads(capsys.readouterr().out)["top"][0]["label"]
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run"]  # fmt: skip
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=flags,
            viewport={"width": 1400, "height": 1000},
        )  # fmt: skip
        try:
            page = ctx.new_page()
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
        finally:
            ctx.close()
