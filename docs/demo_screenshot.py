"""Screenshot of ``vitkit demo`` for the README: start the demo, upload an image in headless chromium, save a PNG.

    python docs/demo_screenshot.py CKPT IMAGE docs/demo.png [--layer 2] [--head 'head 1']

Uses Debian's chromium (/usr/bin/chromium) through Playwright, as the browser test does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("checkpoint")
    ap.add_argument("image")
    ap.add_argument("out")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitkit", "demo", args.checkpoint, "--port", str(port)],
        env={**os.environ, "PYTHONPATH": src},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
            ctx = pw.chromium.launch_persistent_context(
                profile, executable_path=shutil.which("chromium") or "/usr/bin/chromium", headless=True, args=FLAGS,
                viewport={"width": 1280, "height": 900},
            )  # fmt: skip
            page = ctx.new_page()
            page.goto(url, wait_until="domcontentloaded")
            page.locator("#input-image input[type=file]").set_input_files(args.image)
            expect(page.locator("#verdict")).to_contain_text("Prediction", timeout=60_000)
            expect(page.locator("#raw-attention img").first).to_be_visible(timeout=30_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=args.out, full_page=True)
            ctx.close()
    finally:
        proc.terminate()
        proc.wait(20)
    print(args.out)


if __name__ == "__main__":
    main()
