"""The connections of ``vitkit serve`` (:class:`GuardedProtocol`): uvicorn's h11 protocol with deadlines that
arriving bytes never extend, and, near the open-file limit, the longest-idle connections closed to make room for a
new one (:class:`ConnectionTable`). Imported only when a server starts (it imports uvicorn and h11);
:func:`vitkit.serve.net.guarded_protocol` makes the protocol of one server."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class Deadlines:
    """A connection's deadlines in seconds: a whole request head (``head_s``) from the connection opening or its
    last answer; a whole body (``body_s``) from its head; the unread rest of a body after an answer (``linger_s``,
    within ``body_s``)."""

    head_s: float
    body_s: float
    linger_s: float


class ConnectionTable:
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


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines of :class:`Deadlines` and the room-making of
    :class:`ConnectionTable`; :func:`vitkit.serve.net.guarded_protocol` makes the subclass of one server, which
    sets ``deadlines`` and ``table``."""

    deadlines: Deadlines
    table: ConnectionTable
    _timer: asyncio.TimerHandle | None = None
    _stalled: asyncio.TimerHandle | None = None  # the answer waits for the client to read
    _phase, _until, _body_by = "", 0.0, 0.0
    _seen: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.table.open += 1
        self.table.make_room()  # before this one counts as idle: the newcomer is served
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
        """The client does not read its answers: closed unless it reads again within the body deadline."""
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.deadlines.body_s, self.close_now)

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
            self._seen, self._body_by = self.cycle, now + self.deadlines.body_s
        their = self.conn.their_state
        if their is h11.IDLE:
            self._enter("head", now + self.deadlines.head_s, idle=True)
        elif their is h11.SEND_BODY and self.cycle.response_complete:
            self._enter("linger", min(self._body_by, now + self.deadlines.linger_s), idle=True)
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
            self.table.idle[self] = None
            self.table.idle.move_to_end(self)
        else:
            self.table.idle.pop(self, None)

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
        self.table.idle.pop(self, None)
        if self._phase != "gone":
            self._phase = "gone"
            self.table.open -= 1

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
                self.loop.call_later(self.deadlines.linger_s, self.transport.abort)

    def _answer_408(self) -> None:
        body = (
            f'{{"detail": "request body not received within the body timeout of {self.deadlines.body_s:g} s"}}'.encode()
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        events = [
            h11.Response(status_code=408, headers=[*headers, (b"connection", b"close")], reason=b"Request Timeout"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ]
        with suppress(h11.LocalProtocolError):  # h11 says an answer cannot be sent now: just close
            self.transport.write(b"".join(self.conn.send(e) or b"" for e in events))
