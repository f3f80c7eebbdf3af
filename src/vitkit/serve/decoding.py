"""Untrusted uploads decoded in worker processes that can be stopped (``vitkit serve``).

A decoding thread cannot be stopped: an image whose decoder takes minutes (a GIF whose comment is megabytes of
sub-blocks: the cost grows with its square) went on burning a core after its request's 504, holding its decoding
slot, so four such uploads made a 32 px PNG sent 3 s later wait 27 s. Here each image is decoded by
:func:`vitkit.images.decode_image` in a child process (this file run as a script: it imports Pillow and
:mod:`vitkit.images`, not torch), and the process is killed when the decoding outlives ``--decode-timeout`` or its
request gives up (timeout, client gone): its slot and its core are free at once. Workers are reused between images.

Wire format, parent -> child: an 8-byte big-endian length, a 4-byte thumbnail size (0: the image itself; else at
most that many pixels a side, a JPEG decoded at reduced scale and the image made small in the child, so that only
the thumbnail crosses the pipe) and the encoded bytes. Child -> parent: a JSON line (``{"mode", "size", "n"}`` or
``{"error": "too_large"|"bad", "message"}``), then ``n`` bytes of raw pixels.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from contextlib import suppress
from typing import Any, cast

from PIL import Image

from vitkit.errors import DataError
from vitkit.images import ImageTooLarge, convert_image, decode_image

_POLL_S = 0.05  # how often a waiting decode looks at its deadline and at its request's cancellation
_SHARED_MODES = ("L", "RGBA", "RGBX", "CMYK", "I;16", "I;16L", "I;16B")  # Image.frombuffer maps these in place
CHILD_SCRIPT = os.path.abspath(__file__)  # what a worker runs (``python -P``: its folder not on the path)


class DecodeTimeout(ImageTooLarge):
    """An image whose decoding outlived its time: its worker was killed."""


class Decoding:
    """One image's decoding, which the event loop may cancel from another thread (:meth:`cancel`)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.worker: _Worker | None = None

    def cancel(self) -> None:
        """Stop the decoding now: its worker process is killed (the decoding thread then returns at once)."""
        self.cancelled = True
        if self.worker is not None:
            self.worker.kill()


class _Worker:
    """One child process and its two pipes."""

    def __init__(self, max_pixels: int, mode: str) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        for fd in (self._to_child, self._from_child):  # 1 MiB pipes: a 40 MP image in 120 writes, not 1,900
            with suppress(OSError, AttributeError):  # Linux only; the limit may be lower (pipe-max-size)
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        cmd = [sys.executable, "-P", CHILD_SCRIPT, str(to_child_r), str(from_child_w), str(max_pixels), mode]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._buffer = bytearray()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        """Kill the process, reap it, close the pipes (idempotent)."""
        self.kill()
        self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with suppress(OSError):  # closed already
                os.close(fd)
        self._to_child = self._from_child = -1

    def decode(self, data: bytes | bytearray, deadline: float, job: Decoding, thumbnail: int = 0) -> Image.Image:
        """Send ``data``; the decoded image (at most ``thumbnail`` pixels a side when not 0), or the child's
        DataError, or DecodeTimeout at ``deadline``."""
        try:
            os.write(self._to_child, struct.pack(">QI", len(data), thumbnail))
            view = memoryview(data)
            while view:  # the pipe holds 64 KiB: the child reads while we write (it never writes before it has all)
                view = view[os.write(self._to_child, view[: 1 << 20]) :]
        except OSError:  # the child is gone: killed (cancelled), or it died
            self._gone(job)
        head = json.loads(self._read_line(deadline, job))
        if "error" in head:
            kind = ImageTooLarge if head["error"] == "too_large" else DataError
            raise kind(head["message"])
        mode, size, raw = head["mode"], tuple(head["size"]), self._read(int(head["n"]), deadline, job)
        if mode in _SHARED_MODES:  # the image uses the received buffer as it is: no second copy of the pixels
            return Image.frombuffer(mode, size, cast(Any, raw), "raw", mode, 0, 1)  # any buffer will do
        return Image.frombytes(mode, size, raw)

    def _read_line(self, deadline: float, job: Decoding) -> bytes:
        while b"\n" not in self._buffer:
            self._wait(deadline, job)
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                self._gone(job)
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return line

    def _read(self, n: int, deadline: float, job: Decoding) -> bytearray:
        """``n`` bytes, read into one buffer of that size (what is buffered already first)."""
        out, got = bytearray(n), len(self._buffer)
        out[:got] = self._buffer
        self._buffer = bytearray()
        view = memoryview(out)
        while got < n:
            self._wait(deadline, job)
            chunk = os.readv(self._from_child, [view[got:]])
            if not chunk:
                self._gone(job)
            got += chunk
        return out

    def _wait(self, deadline: float, job: Decoding) -> None:
        """Until the child has written something; DecodeTimeout at ``deadline`` or when ``job`` is cancelled."""
        while True:
            if job.cancelled:
                raise DecodeTimeout("image: decoding stopped (its request gave up)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DecodeTimeout("image: too costly to decode (it outlived the decode timeout)")
            poll = select.poll()  # not select(): a busy server's descriptors go past 1024
            poll.register(self._from_child, select.POLLIN)
            if poll.poll(max(1, int(min(_POLL_S, left) * 1000))):
                return

    @staticmethod
    def _gone(job: Decoding) -> None:
        """The child's end of the stream: it was killed (cancelled), or died (out of memory)."""
        if job.cancelled:
            raise DecodeTimeout("image: decoding stopped (its request gave up)")
        raise ImageTooLarge("image: its decoder ran out of resources")


class DecoderPool:
    """Worker processes that decode images and convert them to ``mode`` ("RGB" or "L", as
    :func:`vitkit.images.convert_image`: the pixels the model reads, so the wide ones -- RGBA, 16-bit, float --
    never reach the server), reused; one per image being decoded (the callers' slots bound how many). A decoding
    that outlives ``timeout_s``, or whose :class:`Decoding` is cancelled, kills its worker."""

    def __init__(self, max_pixels: int, timeout_s: float, mode: str = "RGB") -> None:
        self.max_pixels, self.timeout_s, self.mode = max_pixels, timeout_s, mode
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False

    def warm(self, n: int) -> None:
        """Start ``n`` idle workers now, so the first images do not wait for a process to start."""
        workers = [self._start() for _ in range(n)]
        with self._lock:
            self._idle.extend(workers)

    def decode(self, data: bytes | bytearray, job: Decoding, thumbnail: int = 0) -> Image.Image:
        """``data`` decoded by a worker process; DataError (ImageTooLarge, DecodeTimeout) as :func:`decode_image`.
        ``thumbnail``: at most that many pixels a side (a JPEG decoded at reduced scale), 0: the image itself."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or self._start()
        job.worker = worker
        if job.cancelled:  # cancelled before the worker was known to it
            worker.kill()
        reuse = False
        try:
            img = worker.decode(data, time.monotonic() + self.timeout_s, job, thumbnail)
            reuse = True
            return img
        except DataError as e:
            reuse = not isinstance(e, DecodeTimeout) and worker.proc.poll() is None
            raise
        finally:
            job.worker = None
            self._give_back(worker, reuse)

    def close(self) -> None:
        """Kill every worker (those decoding too)."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._all), []
        for w in workers:
            w.close()

    def _start(self) -> _Worker:
        worker = _Worker(self.max_pixels, self.mode)
        with self._lock:
            self._all.add(worker)
        return worker

    def _give_back(self, worker: _Worker, reuse: bool) -> None:
        with self._lock:
            if reuse and not self._closed:
                self._idle.append(worker)
                return
            self._all.discard(worker)
        worker.close()


# ---- the child -------------------------------------------------------------------------------------------------


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _answer(data: bytes, thumbnail: int = 0) -> tuple[dict[str, Any], bytes]:
    try:
        draft = (thumbnail, thumbnail) if thumbnail else None
        img = convert_image(decode_image(data, "image", max_pixels=int(sys.argv[3]), draft=draft), sys.argv[4])
        if thumbnail:
            img.thumbnail((thumbnail, thumbnail), Image.Resampling.BICUBIC)
        raw = img.tobytes()
        return {"mode": img.mode, "size": list(img.size), "n": len(raw)}, raw
    except ImageTooLarge as e:
        return {"error": "too_large", "message": str(e)}, b""
    except DataError as e:
        return {"error": "bad", "message": str(e)}, b""
    except MemoryError:
        return {"error": "too_large", "message": "image: too large to decode in memory"}, b""
    except Exception as e:  # a decoder's own failure on hostile bytes: the image is bad, the worker lives on
        return {"error": "bad", "message": f"image: cannot be decoded ({type(e).__name__})"}, b""


def _child() -> None:
    """Decode images from the parent's pipe until it closes."""
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    while (wire := _read_exact(read_fd, 12)) is not None:
        size, thumbnail = struct.unpack(">QI", wire)
        data = _read_exact(read_fd, size)
        if data is None:
            return
        head, raw = _answer(data, thumbnail)
        out = json.dumps(head).encode() + b"\n"
        for part in (out, raw):
            view = memoryview(part)
            while view:
                view = view[os.write(write_fd, view[: 1 << 20]) :]


if __name__ == "__main__":
    _child()
