"""Dynamic batching, the bounded queue, the request timeout and graceful shutdown, on real loopback servers
(uvicorn in a thread, and ``vitkit serve`` as a subprocess for SIGTERM)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from serve_helpers import free_port, image_bytes, make_checkpoint, metric, uvicorn_thread, wait_healthy  # noqa: E402

from helpers import SRC  # noqa: E402
from vitkit.serve.app import create_app  # noqa: E402
from vitkit.serve.batcher import Batcher, Closed, QueueFull  # noqa: E402
from vitkit.serve.served_model import ServedModel  # noqa: E402
from vitkit.serve.server import ServeOptions  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("batching") / "tiny")


@pytest.fixture(scope="module")
def served(ckpt: Path) -> ServedModel:
    return ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=8)


# ---- the batcher on its own -------------------------------------------------------------------------


def test_batcher_gathers_up_to_max_batch_and_answers_in_order() -> None:
    sizes: list[int] = []
    b: Batcher[int, int] = Batcher(lambda xs: [x * 10 for x in xs], max_batch=4, max_wait_ms=300, max_queue=16)
    b.on_batch = lambda n, _: sizes.append(n)
    b.start()
    futures = [b.submit(i) for i in range(10)]
    assert [f.result(5) for f in futures] == [i * 10 for i in range(10)]
    assert sizes[:2] == [4, 4] and sum(sizes) == 10  # full batches leave at once, the rest after the wait
    b.close()


def test_batcher_waits_at_most_max_wait_ms() -> None:
    b: Batcher[int, int] = Batcher(lambda xs: xs, max_batch=64, max_wait_ms=100, max_queue=64)
    b.start()
    t0 = time.monotonic()
    assert b.submit(1).result(5) == 1
    assert 0.09 <= time.monotonic() - t0 < 2.0
    b.close()


def test_batcher_bounded_queue_cancellation_errors_and_drain() -> None:
    gate = threading.Event()
    ran: list[list[int]] = []

    def run(xs: list[int]) -> list[int]:
        gate.wait(5)
        ran.append(xs)
        if -1 in xs:
            raise ValueError("bad item")
        return xs

    b: Batcher[int, int] = Batcher(run, max_batch=1, max_wait_ms=0, max_queue=2)
    b.start()
    first = b.submit(0)  # the worker takes it and blocks on the gate
    while b.depth:
        time.sleep(0.01)
    waiting = [b.submit(1), b.submit(2)]
    with pytest.raises(QueueFull):
        b.submit(3)
    assert waiting[0].cancel()  # a client that gave up: dropped without compute
    gate.set()
    assert first.result(5) == 0 and waiting[1].result(5) == 2
    with pytest.raises(ValueError, match="bad item"):
        b.submit(-1).result(5)
    assert b.submit(4).result(5) == 4  # the worker survived the failing batch
    assert [1] not in ran
    pending = [b.submit(5), b.submit(6)]
    b.close()  # drains what is queued, then refuses
    assert [f.result(5) for f in pending] == [5, 6]
    with pytest.raises(Closed):
        b.submit(7)


# ---- on a real server -------------------------------------------------------------------------------


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(served: ServedModel) -> None:
    n = 12
    images = [image_bytes(100 + i, (40 + i, 36)) for i in range(n)]
    x = torch.stack([served.to_tensor(Image.open(io.BytesIO(d))) for d in images])
    want = served.probabilities(x)  # one batch, computed directly
    opts = ServeOptions(max_batch=4, max_wait_ms=500, max_queue=64)
    with uvicorn_thread(create_app(served, opts)) as url, ThreadPoolExecutor(n) as pool:

        def ask(i: int) -> dict:
            r = httpx.post(f"{url}/predict?top_k=6", content=images[i], timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        answers = list(pool.map(ask, range(n)))
        text = httpx.get(f"{url}/metrics").text
    for i, doc in enumerate(answers):
        probs = torch.zeros(6)
        for t in doc["top"]:
            probs[t["index"]] = t["prob"]
        torch.testing.assert_close(probs, want[i], atol=1e-5, rtol=0)  # its own image, not a neighbour's
    batches = metric(text, "vitkit_batch_size_count")
    assert metric(text, "vitkit_batch_size_sum") == n and batches < n  # gathered: fewer forwards than requests
    assert metric(text, "vitkit_batch_size_bucket", le="4.0") == batches  # never above --max-batch


def test_full_queue_answers_503_and_timeout_504(served: ServedModel) -> None:
    img = image_bytes(5)
    opts = ServeOptions(max_batch=8, max_wait_ms=3000, max_queue=2, timeout_s=20)
    with uvicorn_thread(create_app(served, opts)) as url, ThreadPoolExecutor(2) as pool:
        first = [pool.submit(httpx.post, f"{url}/predict", content=img, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["queue_depth"] < 2:  # both wait for batch-mates
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.post(f"{url}/predict", content=img, timeout=30)
        assert r.status_code == 503 and "busy" in r.json()["detail"] and r.headers["retry-after"] == "1"
        assert [f.result().status_code for f in first] == [200, 200]
    opts = ServeOptions(max_batch=8, max_wait_ms=3000, timeout_s=0.3)
    with uvicorn_thread(create_app(served, opts)) as url:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/predict", content=img, timeout=30)
        assert r.status_code == 504 and "timeout" in r.json()["detail"] and time.monotonic() - t0 < 2.5
        assert httpx.get(f"{url}/health").status_code == 200
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "vitkit_requests_total", path="/predict", status="504") == 1


class SlowDecoding:
    """``served.to_tensor`` that waits on a gate and records how many images are being decoded at once."""

    def __init__(self, served: ServedModel, gate: threading.Event | None = None, seconds: float = 0.0) -> None:
        self.real, self.gate, self.seconds = served.to_tensor, gate, seconds
        self.calls = self.now = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, img: Image.Image) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            time.sleep(self.seconds)
            return self.real(img)
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture
def slow_served(ckpt: Path) -> ServedModel:
    return ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=8)


def test_a_full_queue_is_refused_before_decoding(slow_served: ServedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests being decoded count against --max-queue: with two images stuck in decoding and a queue of 2, a
    third request is answered 503 at once, and its image is never decoded."""
    gate = threading.Event()
    spy = SlowDecoding(slow_served, gate)
    monkeypatch.setattr(slow_served, "to_tensor", spy)
    opts = ServeOptions(max_batch=8, max_wait_ms=1, max_queue=2, max_decoding=4, timeout_s=20)
    with uvicorn_thread(create_app(slow_served, opts)) as url, ThreadPoolExecutor(2) as pool:
        first = [pool.submit(httpx.post, f"{url}/predict", content=image_bytes(i), timeout=30) for i in range(2)]
        deadline = time.monotonic() + 10
        while spy.now < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(f"{url}/predict", content=image_bytes(9), timeout=30)
        assert r.status_code == 503 and "busy" in r.json()["detail"] and r.headers["retry-after"] == "1"
        gate.set()
        assert [f.result().status_code for f in first] == [200, 200]
    assert spy.calls == 2


def test_images_decoded_at_once_are_bounded(slow_served: ServedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``max_decoding`` images are decoded at once, however many requests arrive (timed-out decodings:
    test_a_timed_out_decoding_gives_its_slot_to_the_next_request)."""
    spy = SlowDecoding(slow_served, seconds=0.3)
    monkeypatch.setattr(slow_served, "to_tensor", spy)
    opts = ServeOptions(max_batch=8, max_wait_ms=1, max_queue=32, max_decoding=2, timeout_s=30)
    with uvicorn_thread(create_app(slow_served, opts)) as url, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: httpx.post(f"{url}/predict", content=image_bytes(i), timeout=30), range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    assert spy.calls == 8 and spy.peak == 2


class Bomb:
    """``served.to_tensor`` that never finishes a 7x7 image until ``gate`` is set (a decompression bomb's cost),
    and converts every other image at once; counts the bombs being decoded."""

    def __init__(self, served: ServedModel) -> None:
        self.real, self.gate, self.lock = served.to_tensor, threading.Event(), threading.Lock()
        self.now = self.others = 0

    def __call__(self, img: Image.Image) -> torch.Tensor:
        if img.size != (7, 7):
            with self.lock:
                self.others += 1
            return self.real(img)
        with self.lock:
            self.now += 1
        try:
            self.gate.wait(60)
        finally:
            with self.lock:
                self.now -= 1
        return self.real(img)


def test_a_timed_out_decoding_gives_its_slot_to_the_next_request(
    slow_served: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-decoding 1: a bomb that times out (504) gives its decoding slot back, so the next normal image is
    served (before: 504 as well, the abandoned decoding held the slot). Abandoned decodings are bounded too: with
    one running already, a second bomb keeps its slot after its 504, and the image after it times out waiting
    for a slot, never decoded."""
    bomb = Bomb(slow_served)
    monkeypatch.setattr(slow_served, "to_tensor", bomb)
    opts = ServeOptions(max_batch=8, max_wait_ms=1, max_queue=32, max_decoding=1, timeout_s=3)
    try:
        with uvicorn_thread(create_app(slow_served, opts)) as url:
            post = lambda data: httpx.post(f"{url}/predict", content=data, timeout=30)  # noqa: E731
            assert post(image_bytes(1, size=(7, 7))).status_code == 504
            assert bomb.now == 1  # still decoding, outside the slots
            assert post(image_bytes(2)).status_code == 200
            assert post(image_bytes(3, size=(7, 7))).status_code == 504
            assert bomb.now == 2
            assert post(image_bytes(4)).status_code == 504  # the second abandoned decoding kept its slot
            bomb.gate.set()
            deadline = time.monotonic() + 10
            while bomb.now:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert post(image_bytes(5)).status_code == 200
            assert bomb.others == 2  # images 2 and 5: image 4 gave up before it had a slot
    finally:
        bomb.gate.set()


def test_idle_connections_do_not_lock_out_health_checks(ckpt: Path) -> None:
    """88 TCP connections that send nothing, on ``vitkit serve --max-batch 1 --max-queue 1`` (uvicorn's connection
    limit was 1 + 1 + 16 = 18, idle connections counted, and /health answered 503): /health and /predict are
    answered, and the idle connections are closed by the server after --header-timeout."""
    import socket

    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--port", str(port), "--precision", "fp32"]
    cmd += ["--max-batch", "1", "--max-queue", "1", "--header-timeout", "2", "--log-level", "error"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(SRC)}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_healthy(proc, url)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(88)]
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends (slowloris)
        held.append(half)
        r = httpx.get(f"{url}/health", timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert httpx.post(f"{url}/predict", content=image_bytes(1), timeout=30).status_code == 200
        for s in held:  # each is closed by the server: recv sees the end of the stream
            s.settimeout(30)
            assert s.recv(1) == b""
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait()


@pytest.fixture
def server_process(ckpt: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--port", str(port), "--precision", "fp32"]
    cmd += ["--max-batch", "8", "--max-wait-ms", "1500", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, printed=lambda: proc.stderr.read() if proc.stderr else "")
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_sigterm_finishes_in_flight_requests(server_process: tuple[subprocess.Popen[str], str]) -> None:
    proc, url = server_process
    with ThreadPoolExecutor(3) as pool:
        inflight = [pool.submit(httpx.post, f"{url}/predict", content=image_bytes(i), timeout=30) for i in range(3)]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["queue_depth"] < 3:  # all three wait 1.5 s for batch-mates
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        answers = [f.result() for f in inflight]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert all(len(r.json()["top"]) == 5 for r in answers)
    # after the graceful shutdown uvicorn re-raises SIGTERM with the default handler, so supervisors see
    # the process ended by the signal they sent (status -15), not by a crash
    assert proc.wait(30) == -signal.SIGTERM
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
