"""What holds ``vitkit serve`` (issue 47): a body that trickles in, or one byte of a body sent after the answer,
must not keep a connection past its deadlines, and ``/health`` is answered while the connection table is full
(item 1); an image that takes long to decode never holds a decoding slot past its request's timeout or
``--decode-timeout`` (item 3, the serving side). Real loopback servers: uvicorn with vitkit's configuration in a
thread, and ``vitkit serve`` as a subprocess under a lowered open-file limit."""

from __future__ import annotations

import io
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from PIL import Image

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from serve_helpers import free_port, image_bytes, make_checkpoint, wait_healthy  # noqa: E402

from helpers import SRC  # noqa: E402
from vitkit.serve.app import create_app  # noqa: E402
from vitkit.serve.net import server_config  # noqa: E402
from vitkit.serve.served_model import ServedModel  # noqa: E402
from vitkit.serve.server import ServeOptions  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("connections") / "tiny")


@contextmanager
def serving(ckpt: Path, opts: ServeOptions) -> Iterator[int]:
    """``vitkit serve``'s uvicorn configuration (protocol, timeouts) for ``opts``, on loopback in a thread;
    yields the port."""
    import uvicorn

    served = ServedModel.from_checkpoint(ckpt, precision="fp32", max_batch=2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(create_app(served, opts), opts, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def head(method: str, path: str, length: int = 1000) -> bytes:
    """A whole request head that declares a body of ``length`` bytes."""
    fields = f"Host: x\r\nContent-Type: image/png\r\nContent-Length: {length}\r\n"
    return f"{method} {path} HTTP/1.1\r\n{fields}\r\n".encode()


def trickle_until_closed(socks: list[socket.socket], seconds: float) -> tuple[dict[int, bytes], float]:
    """Send each socket one body byte every 0.1 s (a slow trickle) until the server closes it, for at most
    ``seconds``; the bytes each one received (by index), and when the last one was closed (inf: one still open)."""
    got = {i: b"" for i in range(len(socks))}
    open_ = dict(enumerate(socks))
    start = time.monotonic()
    while open_ and time.monotonic() - start < seconds:
        for s in list(open_.values()):
            with suppress(OSError):  # closed by the server: the read below sees it
                s.send(b"x")
        readable, _, _ = select.select(list(open_.values()), [], [], 0.1)
        for s in readable:
            i = socks.index(s)
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            got[i] += data
            if not data:
                del open_[i]
    return got, (time.monotonic() - start if not open_ else float("inf"))


def test_a_body_trickled_after_the_answer_does_not_hold_the_connection(ckpt: Path) -> None:
    """``GET /health``, ``/model``, a 405, a 404 and ``POST /predict`` each declare a 1000-byte body that then comes
    one byte at a time: every one is answered and closed within a few seconds (before: uvicorn's keep-alive
    timer was cancelled by every byte, and the connections stayed open for good; /predict after its 504)."""
    opts = ServeOptions(header_timeout_s=2, timeout_s=1)  # keep-alive after an answer: 2 s
    with serving(ckpt, opts) as port:
        requests = [("GET", "/health"), ("GET", "/model"), ("GET", "/predict"), ("GET", "/nope"), ("POST", "/predict")]
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in requests]
        try:
            for s, (method, path) in zip(socks, requests, strict=True):
                s.sendall(head(method, path))
            got, closed_after = trickle_until_closed(socks, seconds=15)
        finally:
            for s in socks:
                s.close()
    statuses = [got[i].split(b" ", 2)[1] if got[i] else b"" for i in range(len(requests))]
    assert statuses == [b"200", b"200", b"405", b"404", b"504"]
    assert closed_after < 10  # 1 s request timeout, then 2 s for the rest of the body; before: never


def test_a_body_that_does_not_arrive_in_time_is_408_and_closed(ckpt: Path) -> None:
    """``POST /predict`` whose 1000-byte body trickles in: answered 408 and closed at ``--body-timeout`` (1 s here),
    long before the request timeout (30 s); the server goes on answering."""
    opts = ServeOptions(header_timeout_s=5, body_timeout_s=1, timeout_s=30)
    with serving(ckpt, opts) as port:
        s = socket.create_connection(("127.0.0.1", port))
        try:
            s.sendall(head("POST", "/predict"))
            got, closed_after = trickle_until_closed([s], seconds=15)
        finally:
            s.close()
        assert got[0].startswith(b"HTTP/1.1 408 ") and b"body timeout of 1 s" in got[0]
        assert closed_after < 5
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_health_answers_under_a_full_connection_table(ckpt: Path, tmp_path: Path) -> None:
    """``vitkit serve`` with an open-file limit of 200 and 300 connections, each answered and then held by one body
    byte: ``/health`` is still answered (before: the held connections took every descriptor, ``accept`` failed
    and health checks timed out for as long as they were held). The longest-idle connections are closed to make
    room before ``accept`` runs out of descriptors, so the new one is served and nothing fails to be accepted."""
    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--port", str(port), "--precision", "fp32"]
    cmd += ["--max-batch", "1", "--max-queue", "4", "--log-level", "critical"]

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    env = {**os.environ, "PYTHONPATH": str(SRC)}
    log = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen(cmd, env=env, stderr=log, preexec_fn=low_fd_limit)
    url = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_healthy(proc, url)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        for s in held:
            s.setblocking(False)
            with suppress(OSError):  # closed to make room for a later one
                s.send(head("GET", "/health"))
        answered = read_answers(held, seconds=5)
        for s in answered:
            with suppress(OSError):
                s.send(b"x")  # one body byte after the answer
        for _ in range(3):
            r = httpx.get(f"{url}/health", timeout=5)
            assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait()
        log.close()
    assert "Too many open files" not in (tmp_path / "stderr").read_text()


def read_answers(socks: list[socket.socket], seconds: float) -> list[socket.socket]:
    """The sockets that received something (an answer, or the end of the stream) within ``seconds``."""
    poll, by_fd, done = select.poll(), {s.fileno(): s for s in socks}, []
    for fd in by_fd:
        poll.register(fd, select.POLLIN)
    deadline = time.monotonic() + seconds
    while len(done) < len(socks) and time.monotonic() < deadline:
        for fd, _ in poll.poll(100):
            poll.unregister(fd)
            with suppress(OSError):
                by_fd[fd].recv(65536)
            done.append(by_fd[fd])
    return done


# ---- decoding never delays other requests past their own timeout (issue 47, item 3, the serving side) ----------


def gif_comment_bomb(mib: int) -> bytes:
    """An 8x8 GIF whose comment extension is ``mib`` MiB of 255-byte sub-blocks (Pillow's cost grows with the
    square of the comment: seconds for a few MiB)."""
    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, format="GIF")
    gif = buf.getvalue()
    table = 3 * 2 ** ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0
    at = 13 + table  # after the screen descriptor and the global colour table
    comment = b"\x21\xfe" + (b"\xff" + b"c" * 255) * (mib * (1 << 20) // 256) + b"\x00"
    return gif[:at] + comment + gif[at:]


def test_decoder_bombs_that_time_out_do_not_hold_the_decoding_slots(ckpt: Path) -> None:
    """--max-decoding 1, --timeout 1.5: two 12 MiB GIF comment bombs (seconds of decoding each), then a normal
    image: it is answered (before: 504, the second bomb's decoding thread, which cannot be stopped, kept the only
    slot past its own 504 and the normal image timed out waiting for it)."""
    bomb = gif_comment_bomb(12)
    opts = ServeOptions(max_decoding=1, timeout_s=1.5, max_wait_ms=1)
    with serving(ckpt, opts) as port:
        url = f"http://127.0.0.1:{port}/predict"
        for _ in range(2):
            r = httpx.post(url, content=bomb, headers={"content-type": "image/gif"}, timeout=30)
            assert r.status_code in (400, 413, 504)  # timed out, or refused from its structure
        assert httpx.post(url, content=image_bytes(1), timeout=30).status_code == 200


def test_a_decoding_that_outlives_the_decode_timeout_is_stopped(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder that never finishes (hanging_decoder.py, whatever the image checks refuse): 413 at
    --decode-timeout (1 s here), well inside the request timeout (30 s), its worker process killed; the next
    image is decoded in the only slot at once, and when the server stops no worker process is left."""
    from vitkit.serve import decoding

    monkeypatch.setattr(decoding, "CHILD_SCRIPT", str(Path(__file__).parent / "hanging_decoder.py"))
    opts = ServeOptions(max_decoding=1, timeout_s=30, decode_timeout_s=1, max_wait_ms=1)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen:
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    monkeypatch.setattr(decoding.subprocess, "Popen", popen)
    with serving(ckpt, opts) as port:
        url = f"http://127.0.0.1:{port}/predict"
        r = httpx.post(url, content=image_bytes(1, size=(7, 7)), timeout=30)
        assert r.status_code == 413 and "decode timeout of 1 s" in r.json()["detail"]
        assert started[0].wait(5) is not None  # killed
        assert httpx.post(url, content=image_bytes(2), timeout=30).status_code == 200
    assert all(p.poll() is not None for p in started)


def test_decoding_works_with_descriptors_past_1024() -> None:
    """A busy server's descriptors go past 1024 (connections): a decoding worker started then still answers (its
    pipes are waited on with poll; select() refuses descriptors past 1023)."""
    from vitkit.serve.decoding import DecoderPool, Decoding

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("needs an open-file limit of 1200")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    pool = DecoderPool(1_000_000, 10)
    try:
        img = pool.decode(image_bytes(1), Decoding())
        assert img.size == (60, 40) and img.mode == "RGB"
    finally:
        pool.close()
        for fd in held:
            os.close(fd)


def test_a_client_that_does_not_read_its_answers_is_closed(ckpt: Path) -> None:
    """Requests pipelined by a client that never reads the answers (a small receive buffer, so the server's
    writes stall at once): the connection is dropped --body-timeout (1 s) after the answers stop going out, plus
    the keep-alive (1 s) for what was written already, before the client reads anything (before: held, the next
    answer waiting for as long as the client stayed)."""
    opts = ServeOptions(header_timeout_s=1, body_timeout_s=1)
    with serving(ckpt, opts) as port:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
        try:
            for _ in range(2000):  # until the server stops reading them
                with suppress(BlockingIOError):
                    s.send(request)
            time.sleep(4)
            s.setblocking(True)
            s.settimeout(10)
            got, ended = 0, False
            for _ in range(100_000):  # what was on its way, then the end: no answer goes out any more
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    ended = True
                    break
                got += len(data)
            # at most what the kernel had queued already (a few MB); before: reading let the server go on through
            # all 2000 answers (12.8 MB)
            assert ended and got < 8 << 20
        finally:
            s.close()


@pytest.mark.parametrize("option", ["--body-timeout", "--decode-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_timeout_is_one_line_naming_it(
    ckpt: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    """The two new timeouts take positive, finite seconds: anything else is one line naming the option, exit 2."""
    from helpers import run_cli

    code, _, err = run_cli(capsys, "serve", str(ckpt), option, value)
    assert code == 2 and err.strip().count("\n") == 0 and option in err, err
