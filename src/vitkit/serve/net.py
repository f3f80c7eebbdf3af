"""The listening address of ``vitkit serve`` and ``vitkit demo``, taken before anything else happens, so a port
already in use is one line naming ``--port`` (exit 2) instead of a banner followed by a server's own errors; and
the uvicorn configuration of ``vitkit serve`` (:func:`server_config`: no connection limit that idle connections
could fill; deadlines for a request's head and for its body that arriving bytes do not extend; and, when the open
connections near the process's open-file limit, the longest-idle connections closed to make room for new ones)."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections import OrderedDict
from contextlib import suppress
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


class _Table:
    """The connections of one server that may be closed to make room (none of their requests in progress: waiting
    for a head, or for the rest of a body already answered), longest-idle first, and how many are open."""

    def __init__(self, limit: int) -> None:
        self.limit, self.open = limit, 0
        self.idle: OrderedDict[Any, None] = OrderedDict()

    def make_room(self) -> None:
        """Close the longest-idle connections while more than ``limit`` are open."""
        while self.open > self.limit and self.idle:
            oldest, _ = self.idle.popitem(last=False)
            oldest.close_now()


def guarded_protocol(head_s: float, body_s: float, linger_s: float, limit: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with deadlines that arriving bytes never extend (uvicorn's keep-alive timer is
    cancelled by any byte, so one body byte sent after an answer held a connection for good):

    - a whole request head within ``head_s`` of the connection opening, or of its last answer;
    - the whole body within ``body_s`` of its head (else 408 when nothing was answered yet, and closed);
    - after an answer, the rest of a body the application did not read within ``linger_s`` (and ``body_s``);
    - an answer the client stops reading (the write buffer over its high-water mark) read again within ``body_s``;

    and at most ``limit`` connections open: past it, the longest-idle ones (in the first and last case above) are
    closed as a new one arrives. A request whose body arrived is bounded by the application's request timeout."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    table = _Table(limit)

    class GuardedProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _stalled: asyncio.TimerHandle | None = None  # the answer waits for the client to read
        _phase, _until, _body_by = "", 0.0, 0.0
        _seen: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            table.open += 1
            table.make_room()  # before this one counts as idle: the newcomer is served
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._forget()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            """The client does not read its answers: closed unless it reads again within ``body_s``."""
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(body_s, self.close_now)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _watch(self) -> None:
            """Which deadline holds now, from the h11 states; a deadline set for a phase is never moved later."""
            if self.transport.is_closing():
                self._forget()
                return
            now = self.loop.time()
            if self.cycle is not self._seen:  # a new request's head arrived
                self._seen, self._body_by = self.cycle, now + body_s
            their = self.conn.their_state
            if their is h11.IDLE:
                self._enter("head", now + head_s, idle=True)
            elif their is h11.SEND_BODY and self.cycle.response_complete:
                self._enter("linger", min(self._body_by, now + linger_s), idle=True)
            elif their is h11.SEND_BODY:
                self._enter("body", self._body_by, idle=False)
            else:  # the whole request arrived: the application's timeout bounds it
                self._enter("busy", None, idle=False)

        def _enter(self, phase: str, until: float | None, *, idle: bool) -> None:
            if phase == self._phase and (phase != "body" or until == self._until):
                return  # the same phase (of the same request): its deadline stands
            self._phase = phase
            self._cancel()
            if until is not None:
                self._until = until
                self._timer = self.loop.call_at(until, self._expired)
            if idle:
                table.idle[self] = None
                table.idle.move_to_end(self)
            else:
                table.idle.pop(self, None)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _forget(self) -> None:
            """No longer counted: closing, or closed."""
            self._cancel()
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None
            table.idle.pop(self, None)
            if self._phase != "gone":
                self._phase = "gone"
                table.open -= 1

        def _expired(self) -> None:
            self._timer = None
            if self._phase == "body" and self.cycle is not None and not self.cycle.response_started:
                self._answer_408()
            self.close_now()

        def close_now(self) -> None:
            """Close the connection; a request still being read sees its client gone."""
            self._forget()
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the application's answer, if any, goes nowhere
                self.cycle.message_event.set()  # a read of the body ends
            if not self.transport.is_closing():
                self.transport.close()  # after what is written already has gone out...
                if self.transport.get_write_buffer_size():  # ...which a client that does not read never takes
                    self.loop.call_later(linger_s, self.transport.abort)

        def _answer_408(self) -> None:
            body = f'{{"detail": "request body not received within the body timeout of {body_s:g} s"}}'.encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            events = [
                h11.Response(status_code=408, headers=[*headers, (b"connection", b"close")], reason=b"Request Timeout"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ]
            with suppress(h11.LocalProtocolError):  # h11 says an answer cannot be sent now: just close
                self.transport.write(b"".join(self.conn.send(e) or b"" for e in events))

    return GuardedProtocol
