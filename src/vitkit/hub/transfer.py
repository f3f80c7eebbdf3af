"""One file's bytes over HTTP(S) into a partial file, for :mod:`vitkit.hub.download` (which owns the cache, the
lock, the digest and the rename into place): resumed with a ``Range`` request after a cut, at most
``max_bytes``, never following a redirect from ``https`` to plain ``http``, written without following links;
every failure a one-line :class:`DownloadError` that says what to do."""

from __future__ import annotations

import errno
import http.client
import os
import re
import shutil
import socket
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from vitkit.errors import VitkitError
from vitkit.hub.cache import ENV_VAR

CHUNK = 1 << 20
#: The most bytes one download may have (``download(max_bytes=)``): a larger Content-Length is refused before
#: anything is written, and the body is never read past it. The registry's largest file is about 2.5 GB.
MAX_DOWNLOAD_BYTES = 16 << 30
USER_AGENT = "vitkit"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW


class DownloadError(VitkitError):
    """A file could not be fetched or verified; the message says what to do instead."""


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (False if missing); DownloadError for anything else there (a
    symbolic link, a folder), which vitkit did not put there and neither follows nor removes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise DownloadError(f"{path}: {kind} where vitkit keeps its own file; remove it and try again")
    return True


def what_to_do(url: str) -> str:
    """The way out an error offers: fetch the file by other means."""
    return f"download {url} yourself and pass its path"


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    """Redirects as urllib follows them, except from ``https`` to anything else (plain ``http``)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: object, code: int, msg: str, headers: object, newurl: str
    ) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if urllib.parse.urlsplit(req.full_url).scheme.lower() == "https" and scheme != "https":
            raise DownloadError(
                f"{req.full_url}: redirected to {scheme}:// ({newurl}), which is not encrypted; refused "
                f"(vitkit follows https only to https): {what_to_do(req.full_url)} if you trust it"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)  # type: ignore[arg-type]


def _request(url: str, start: int, timeout: float) -> http.client.HTTPResponse:
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if start:
        headers["Range"] = f"bytes={start}-"
    opener = urllib.request.build_opener(_NoDowngrade)
    try:
        resp: http.client.HTTPResponse = opener.open(urllib.request.Request(url, headers=headers), timeout=timeout)
        return resp
    except urllib.error.HTTPError as e:
        if e.code == 416 and start:
            raise _RangeRefused() from None
        if e.code in (404, 410):
            raise DownloadError(f"{url}: not found (HTTP {e.code}); check the name or URL") from None
        if e.code in (401, 403):
            raise DownloadError(
                f"{url}: access denied (HTTP {e.code}); the file is not public: {what_to_do(url)}"
            ) from None
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; try again later or {what_to_do(url)}") from None
    except urllib.error.URLError as e:
        raise _network_error(url, e.reason, timeout) from None
    except (TimeoutError, OSError) as e:
        raise _network_error(url, e, timeout) from None
    except (http.client.HTTPException, UnicodeError) as e:  # a malformed status line, over 100 headers ...
        raise _malformed(url, e) from None


def _malformed(url: str, e: Exception, discard: Path | None = None) -> DownloadError:
    """The error for an answer that is not well-formed HTTP (``e`` says what was wrong, cut to one line); the
    partial file ``discard`` is removed (its bytes came from that answer)."""
    if discard is not None:
        discard.unlink(missing_ok=True)
    why = " ".join(str(e).split())[:200] or type(e).__name__
    return DownloadError(f"{url}: malformed HTTP answer ({type(e).__name__}: {why}); {what_to_do(url)}")


class _RangeRefused(Exception):
    pass


def _network_error(url: str, reason: object, timeout: float) -> DownloadError:
    if isinstance(reason, TimeoutError | socket.timeout):
        return DownloadError(f"{url}: timed out after {timeout:g} s; try again later or {what_to_do(url)}")
    host = urllib.parse.urlsplit(url).netloc
    return DownloadError(f"{url}: cannot reach {host} ({reason}); offline? {what_to_do(url)}")


def disk_full(path: Path) -> DownloadError:
    """The error for a full disk at ``path``."""
    return DownloadError(
        f"{path}: disk full; free some space, or put the cache on a larger disk with --cache-dir or {ENV_VAR}"
    )


def _content_range(resp: http.client.HTTPResponse) -> tuple[int, int | None]:
    """(first byte, total size or None) of a 206 response."""
    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", ""))
    if not m:
        return -1, None
    return int(m.group(1)), None if m.group(2) == "*" else int(m.group(2))


def _content_length(resp: http.client.HTTPResponse, url: str) -> int | None:
    """The Content-Length of a whole-file answer (None without one); DownloadError for one that is not a number
    in ASCII digits (``²`` passes ``str.isdigit`` and fails ``int``)."""
    length = resp.headers.get("Content-Length")
    if length is None:
        return None
    if not re.fullmatch(r"[0-9]{1,20}", length.strip()):
        raise DownloadError(f"{url}: malformed HTTP answer (Content-Length {length!r}); {what_to_do(url)}")
    return int(length)


def _too_large(url: str, size: int | str, max_bytes: int) -> DownloadError:
    return DownloadError(
        f"{url}: {size} bytes, more than the {max_bytes} bytes vitkit downloads for one file (max_bytes); "
        f"{what_to_do(url)} if you expect a file that large"
    )


def fetch(
    url: str, part: Path, timeout: float, retries: int, progress: bool, label: str, max_bytes: int = MAX_DOWNLOAD_BYTES
) -> None:
    """Fill ``part`` with the whole body of ``url`` (at most ``max_bytes``), resuming after cuts; raises
    DownloadError."""
    attempts = 0
    bar: tqdm | None = None
    try:
        while True:
            start = part.stat().st_size if regular_file(part) else 0
            try:
                resp = _request(url, start, timeout)
            except _RangeRefused:
                part.unlink()  # the partial does not fit the file any more: start again
                continue
            with resp:
                total: int | None
                if start and resp.status == 206:
                    first, total = _content_range(resp)
                    if first != start:
                        part.unlink()
                        continue
                else:
                    start, total = 0, _content_length(resp, url)
                if total is not None and total > max_bytes:
                    raise _too_large(url, total, max_bytes)
                if total is not None and total - start > shutil.disk_usage(part.parent).free:
                    raise disk_full(part.parent)
                if bar is None:
                    bar = tqdm(
                        total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                        file=sys.stderr, disable=not progress, dynamic_ncols=True,
                    )  # fmt: skip
                else:
                    bar.reset(total=total)
                    bar.update(start)
                got = start
                try:
                    with _open_partial(part, append=bool(start)) as f:
                        while block := resp.read(min(CHUNK, max_bytes + 1 - got)):
                            f.write(block)
                            got += len(block)
                            bar.update(len(block))
                            if got > max_bytes:
                                break
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise disk_full(part.parent) from None
                    if isinstance(e, TimeoutError | ConnectionError):
                        cut: Exception | None = e
                    else:
                        raise DownloadError(f"{part}: cannot write ({e.strerror or e})") from None
                except http.client.IncompleteRead as e:
                    cut = e
                except http.client.HTTPException as e:  # a chunk-size line over http.client's limit ...
                    raise _malformed(url, e, discard=part) from None
                else:
                    cut = None
                if got > max_bytes:
                    part.unlink()
                    raise _too_large(url, f"more than {max_bytes}", max_bytes)
                if cut is None and (total is None or got == total):
                    return
                if cut is None and total is not None and got > total:
                    part.unlink()
                    raise DownloadError(f"{url}: server sent {got} bytes for a {total}-byte file; try again later")
            attempts += 1
            if attempts > retries:
                raise DownloadError(
                    f"{url}: connection cut after {got} of {total if total is not None else '?'} bytes "
                    f"({attempts} attempts); run the command again to resume, or {what_to_do(url)}"
                )
            time.sleep(min(0.2 * attempts, 2.0))
    finally:
        if bar is not None:
            bar.close()


def _open_partial(part: Path, append: bool) -> BinaryIO:
    """The partial file opened for writing without following a link: to go on at its end (``append``), or
    new (O_EXCL: a partial file left from before, vitkit's own regular file, is removed first)."""
    if append:
        return os.fdopen(os.open(part, os.O_WRONLY | os.O_APPEND | NOFOLLOW), "ab")
    if regular_file(part):
        part.unlink()
    return os.fdopen(os.open(part, NEW_FILE, 0o666), "wb")
