"""The listening address of ``vitkit serve`` and ``vitkit demo``, taken before anything else happens, so a port
already in use is one line naming ``--port`` (exit 2) instead of a banner followed by a server's own errors; and
the uvicorn configuration of ``vitkit serve`` (:func:`server_config`: no connection limit that idle connections
could fill, a timeout for a request's head)."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from vitkit.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` the way uvicorn binds one (SO_REUSEADDR; IPv6 when the host has a
    colon), not yet listening; uvicorn takes it as it is (``Server.run(sockets=[...])``).

    Raises ConfigError naming ``--port`` when the port is taken or needs privileges, ``--host`` when the host is
    not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise ConfigError(f"--host {host}: not a name or address of this machine ({e.strerror})") from None
    except OSError as e:
        sock.close()
        raise ConfigError(_bind_error(host, port, e)) from None
    sock.set_inheritable(True)
    return sock


def check_free(host: str, port: int) -> None:
    """Raise ConfigError (as :func:`bind`) unless ``host``:``port`` can be listened on now."""
    bind(host, port).close()


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is already in use by another program; choose another --port"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied to listen on {host}:{port} (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})"


def server_config(app: Any, opts: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` of ``vitkit serve`` for ``app`` and its :class:`~vitkit.serve.app.ServeOptions`.

    No connection limit (uvicorn's ``limit_concurrency`` counts idle connections, so 88 sockets that send
    nothing answered every later request, health checks included, with 503): the app's own admission control
    (``--max-queue``, ``--max-decoding``) bounds the work, and a connection that has not sent a whole request
    head within ``opts.header_timeout_s`` of opening (or of its last answer) is closed."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=head_timeout_protocol(opts.header_timeout_s),
        limit_concurrency=None,
        timeout_keep_alive=max(1, min(5, int(opts.header_timeout_s))),  # idle after an answer: uvicorn's own
        timeout_graceful_shutdown=int(opts.timeout_s) + 5,  # in-flight requests finish, bounded
    )


def head_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, plus a timer from the moment a connection opens (and from each answer) to the
    moment a whole request head has arrived: a connection that sends nothing, or a head a byte at a time, is
    closed after ``seconds``. A request whose head arrived is bounded by the app's request timeout instead."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived: the request timeout takes over
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # waiting for the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol
