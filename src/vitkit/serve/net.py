"""The listening address of ``vitkit serve`` and ``vitkit demo``, taken before anything else happens, so a port
already in use is one line naming ``--port`` (exit 2) instead of a banner followed by a server's own errors; and
the uvicorn configuration of ``vitkit serve`` (:func:`server_config`: no connection limit that idle connections
could fill; deadlines for a request's head and for its body that arriving bytes do not extend; and, when the open
connections near the process's open-file limit, the longest-idle connections closed to make room for new ones)."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from vitkit.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` the way uvicorn binds one (SO_REUSEADDR; IPv6 when the host has a
    colon), not yet listening; uvicorn takes it as it is (``Server.run(sockets=[...])``).

    Raises ConfigError naming ``--port`` when the port is not 1..65535, is taken or needs privileges, ``--host``
    when the host is not an address of this machine.
    """
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port}: must be 1..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(_bind_error(host, port, e)) from None
    sock.set_inheritable(True)
    return sock


def check_free(host: str, port: int) -> None:
    """Raise ConfigError (as :func:`bind`) unless ``host``:``port`` can be listened on now."""
    bind(host, port).close()


def _bind_error(host: str, port: int, e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return f"--host {host}: not a name or address of this machine ({e.strerror})"
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is already in use by another program; choose another --port"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied to listen on {host}:{port} (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})"


#: File descriptors kept free for the server's own files (checkpoints, logs), besides those of the admitted requests
#: (an upload spooled to disk), of the decoding workers' pipes and of one ``accept`` burst.
FD_RESERVE = 64


def server_config(app: Any, opts: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` of ``vitkit serve`` for ``app`` and its :class:`~vitkit.serve.server.ServeOptions`.

    No connection limit that refuses (uvicorn's ``limit_concurrency`` counts idle connections, so 88 sockets that
    send nothing answered every later request, health checks included, with 503): the app's own admission control
    (``--max-queue``, ``--max-decoding``) bounds the work, and :func:`guarded_protocol` bounds each connection's
    time (``opts.header_timeout_s`` for a head, ``opts.body_timeout_s`` for a body) and, near the open-file limit,
    closes the longest-idle connections so that a new one (a health check) is always accepted and answered."""
    import uvicorn

    keep_alive = max(1, min(5, int(opts.header_timeout_s)))  # idle after an answer: uvicorn's own
    backlog, most = connection_limits(opts.max_queue + 4 * opts.decoders)  # two pipes per decoding process
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(opts.header_timeout_s, opts.body_timeout_s, keep_alive, most),
        limit_concurrency=None,
        backlog=backlog,
        timeout_keep_alive=keep_alive,
        timeout_graceful_shutdown=int(opts.timeout_s) + 5,  # in-flight requests finish, bounded
    )


def connection_limits(reserve: int) -> tuple[int, int]:
    """``(backlog, most)`` from the process's open-file limit (soft): the listen backlog, which is also how many
    connections asyncio accepts in one go (an eighth of the limit, 16..2048), and the open connections kept at
    most (the limit less that burst, ``reserve`` -- the server's descriptors per admitted request and per decoding
    worker -- and :data:`FD_RESERVE`; at least 16). Past ``most`` the
    longest-idle connections are closed, so ``accept`` never runs out of descriptors (it did with 1,017 connections
    each held by one body byte: ``/health`` went unanswered, and every failed ``accept`` of a burst logged a
    traceback)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    backlog = max(16, min(2048, soft // 8))
    return backlog, max(16, soft - backlog - reserve - FD_RESERVE)


def guarded_protocol(head_s: float, body_s: float, linger_s: float, limit: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with deadlines that arriving bytes never extend (uvicorn's keep-alive timer is
    cancelled by any byte, so one body byte sent after an answer held a connection for good):

    - a whole request head within ``head_s`` of the connection opening, or of its last answer;
    - the whole body within ``body_s`` of its head (else 408 when nothing was answered yet, and closed);
    - after an answer, the rest of a body the application did not read within ``linger_s`` (and ``body_s``);
    - an answer the client stops reading (the write buffer over its high-water mark) read again within ``body_s``;

    and at most ``limit`` connections open: past it, the longest-idle ones (in the first and last case above) are
    closed as a new one arrives. A request whose body arrived is bounded by the application's request timeout."""
    from vitkit.serve.connections import ConnectionTable, Deadlines, GuardedProtocol

    attrs = {"deadlines": Deadlines(head_s, body_s, linger_s), "table": ConnectionTable(limit)}
    return type("GuardedProtocol", (GuardedProtocol,), attrs)
