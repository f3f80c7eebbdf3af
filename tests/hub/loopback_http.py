"""Helpers of the hub tests (imported by them; no conftest.py, whose module name the top-level one owns).

A real HTTP server on loopback: serves files (with Range), cuts a connection mid-body, answers 404, serves
wrong bytes, or stalls. ``private_caches``: vitkit's and huggingface_hub's caches in temp dirs, Hub offline."""

from __future__ import annotations

import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


@dataclass
class Server:
    base: str
    files: dict[str, bytes] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before cutting (every request)
    cut_times: dict[str, int] = field(default_factory=dict)  # path -> how many requests get cut
    wrong: dict[str, bytes] = field(default_factory=dict)  # path -> bytes served instead of files[path]
    stall: dict[str, float] = field(default_factory=dict)  # path -> seconds to wait before answering
    no_range: set[str] = field(default_factory=set)  # paths served whole (200) even when a Range is asked
    endless: set[str] = field(default_factory=set)  # paths whose body never ends (no Content-Length)
    redirect: dict[str, str] = field(default_factory=dict)  # path -> URL answered with 302 Location
    sent: dict[str, int] = field(default_factory=dict)  # path -> body bytes written, for endless paths
    log: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)

    def url(self, path: str) -> str:
        return self.base + path


def _handler(state: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def do_GET(self) -> None:
            path = self.path
            state.log.append((path, self.headers.get("Range")))
            if path in state.stall:
                time.sleep(state.stall[path])
            if path in state.redirect:
                self.send_response(302)
                self.send_header("Location", state.redirect[path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if path in state.endless:
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                block = b"\0" * 65536
                state.sent[path] = 0
                try:
                    while state.sent[path] < 1 << 30:  # 1 GiB: far past any cap a test sets
                        self.wfile.write(block)
                        state.sent[path] += len(block)
                except OSError:
                    pass  # the client hung up: what a capped download does
                return
            if path not in state.files:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = state.wrong.get(path, state.files[path])
            start = 0
            m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if m and path not in state.no_range:
                start = int(m.group(1))
                if start >= len(body):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            chunk = body[start:]
            self.send_header("Content-Length", str(len(chunk)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if state.cut_times.get(path, 0) > 0:
                state.cut_times[path] -= 1
                self.wfile.write(chunk[: state.cut_after[path]])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(chunk)

    return Handler


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up on a cut connection is what the tests want


@contextmanager
def serve(tls: ssl.SSLContext | None = None) -> Iterator[Server]:
    """A loopback server; over TLS with ``tls`` (a server context, e.g. from :func:`self_signed`)."""
    server = _Quiet(("127.0.0.1", 0), BaseHTTPRequestHandler)
    scheme = "http"
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    state = Server(base=f"{scheme}://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def self_signed(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A TLS server context for 127.0.0.1 and the certificate file a client trusts it by (``SSL_CERT_FILE``),
    made with the openssl command (the test is skipped without it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx, cert


@pytest.fixture(name="http_server")
def http_server_fixture() -> Iterator[Server]:
    with serve() as state:
        yield state


@pytest.fixture(autouse=True, name="private_caches")
def private_caches_fixture(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing a test does lands in the user's caches: vitkit's and huggingface_hub's point at temp dirs,
    and the Hub is offline (tests never touch the internet)."""
    import huggingface_hub.constants as hf_constants

    root = tmp_path_factory.mktemp("caches")
    monkeypatch.setenv("VITKIT_HOME", str(root / "vitkit"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(root / "hf-hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


def put_in_hub_cache(folder: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay a folder out as huggingface_hub's cache does: models--org--name/{snapshots/<commit>, refs/<ref>}; the
    snapshot folder."""
    import huggingface_hub.constants as c

    repo = Path(c.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit
