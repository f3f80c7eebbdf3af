"""Checkpoints, images and a real loopback uvicorn server for the serving tests."""

from __future__ import annotations

import io
import socket
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from helpers import randomize_
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.checkpoints.vitkit_format import save
from vitkit.models import create_model

CLASSES = ["cat", "dog", "ship", "tree", "car", "bird"]


def make_checkpoint(path: Path) -> Path:
    """A small randomised ViT (32x48 px input, patch 8, class token) saved with class names and a crop
    preprocessing, so labels and resizing both come from the checkpoint."""
    model = create_model(
        "Ti/16", patch_size=8, image_size=(32, 48), hidden_size=32, depth=2, num_heads=2, mlp_dim=64,
        num_classes=len(CLASSES),
    )  # fmt: skip
    randomize_(model, std=0.2)
    pre = Preprocess(image_size=(32, 48), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), resize="crop", crop_pct=0.875)
    return save(model.eval(), path, preprocess=pre, class_names=CLASSES)


def image_bytes(seed: int, size: tuple[int, int] = (60, 40), fmt: str = "PNG") -> bytes:
    """A random RGB image (width, height) encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def png_header_bomb(width: int, height: int) -> bytes:
    """A few-hundred-byte PNG whose header claims width x height pixels (a decompression bomb's shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def uvicorn_thread(app: Any) -> Iterator[str]:
    """Run ``app`` on a real uvicorn server on loopback in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def wait_healthy(
    proc: subprocess.Popen[Any],
    url: str,
    seconds: float = 60,
    *,
    path: str = "/health",
    printed: Callable[[], str] = lambda: "",
) -> None:
    """Wait until the ``vitkit serve`` (or ``demo``) process ``proc`` answers ``url`` + ``path`` with 200; an
    AssertionError with what it ``printed`` if it exits or ``seconds`` pass first."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{' '.join(map(str, proc.args[2:4]))} did not start:\n{printed()}")
        time.sleep(0.1)


@contextmanager
def vitkit_server(args: list[str], *, log: Path | None = None, ready: str = "/health") -> Iterator[tuple[str, Any]]:
    """``python -m vitkit ARGS --port P`` (``serve`` or ``demo``) as a subprocess on loopback, yielded as (base URL,
    process) once ``ready`` answers 200 (AssertionError with what it printed when it exits or takes over 120 s
    first). Its output goes to ``log``, or to a pipe the caller may read; it is stopped afterwards (SIGTERM, then
    SIGKILL after 20 s)."""
    import os
    import sys

    from helpers import SRC

    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", *args, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = log.open("w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        out.close()  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"

    def printed() -> str:
        return log.read_text() if log is not None else proc.stdout.read() if proc.stdout else ""

    try:
        wait_healthy(proc, url, 120, path=ready, printed=printed)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def chromium_page(profile: Path) -> Iterator[tuple[Any, Any]]:
    """(Playwright's sync API, a new page) in Debian's headless chromium with a profile folder of its own; the test
    is skipped where chromium or Playwright is not installed, and fails on CI without chromium (``.ci/run``
    installs it)."""
    import os
    import shutil

    import pytest

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed on CI (.ci/run installs it with apt-get)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run"]  # fmt: skip
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=flags, viewport={"width": 1400, "height": 1000}
        )
        try:
            yield sync_api, ctx.new_page()
        finally:
            ctx.close()
