"""``vitkit download`` against a server that answers malformed HTTP, and against malformed URLs (issue 47,
item 9): each is one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from loopback_http import private_caches_fixture  # noqa: F401 (fixture)

from vitkit.cli import main

# raw answers, each sent whole to whatever request arrives
ANSWERS = {
    "superscript length": b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\nConnection: close\r\n\r\nab",
    "malformed status line": b"HTTP/1.1 twohundred OK\r\n\r\n",
    "101 headers": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n",
    "70 KB chunk-size line": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    + b"1" * 70_000
    + b"\r\n",
}


@contextmanager
def raw_server(answer: bytes) -> Iterator[str]:
    """A loopback server that reads a request head and sends ``answer`` as it is, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                with conn:
                    conn.settimeout(5)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        got = conn.recv(4096)
                        if not got:
                            break
                        head += got
                    conn.sendall(answer)
            except OSError:
                pass  # the client hung up first

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/w/model.npz"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, url: str) -> str:
    code = main(["download", url, "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_a_malformed_answer_is_one_line(case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with raw_server(ANSWERS[case]) as url:
        err = one_line_error(capsys, tmp_path, url)
    assert url in err
    assert not list((tmp_path / "cache").rglob("model.npz")), "nothing may be cached from a malformed answer"


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a b.npz", "http://[::1/x", "http://127.0.0.1:9/a\tb"])
def test_a_malformed_url_is_one_line(url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, tmp_path, url)
    assert "not a valid URL" in err
