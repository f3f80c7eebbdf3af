"""Downloads that never hand over a bad file.

``download(url)`` returns the path of a complete, verified copy of ``url`` in the cache:

- the bytes go to ``<cache>/downloads/.partial/...`` and are renamed into place only once complete and
  checked, so the cache never serves a partial or corrupt file;
- a connection cut mid-body is resumed with an HTTP ``Range`` request (within the call, and by the next
  call from the partial file it left);
- the SHA-256 is checked against a published digest when one is given and recorded on first download
  otherwise (``<cache>/downloads/.records/...json``); a cached file whose size or time stamp changed since
  is re-hashed and refused if it no longer matches;
- failures (offline, 404, timeout, disk full, wrong digest) are one-line :class:`DownloadError`\\ s that say
  what to do, e.g. download the file yourself and pass its path.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock
from tqdm import tqdm

from vitkit.errors import VitkitError
from vitkit.fileio import fsync
from vitkit.hub.cache import ENV_VAR, cache_dir

CHUNK = 1 << 20
USER_AGENT = "vitkit"


class DownloadError(VitkitError):
    """A file could not be fetched or verified; the message says what to do instead."""


@dataclass(frozen=True)
class Record:
    """What vitkit knows about a file it downloaded (written beside the cache, never inside the file)."""

    url: str
    sha256: str
    size: int
    mtime_ns: int
    published_sha256: bool  # True when checked against a digest given by the registry/caller


def gs_to_https(url: str) -> str:
    """``gs://bucket/path`` -> ``https://storage.googleapis.com/bucket/path`` (public buckets' HTTPS endpoint)."""
    if not url.startswith("gs://"):
        return url
    rest = url[len("gs://") :]
    return "https://storage.googleapis.com/" + urllib.parse.quote(rest, safe="/")


def is_url(name: str) -> bool:
    return name.startswith(("http://", "https://", "gs://"))


def _safe_parts(url: str) -> list[str]:
    """Cache-relative path components for ``url``: host, then its path, with nothing that climbs out."""
    u = urllib.parse.urlsplit(url)
    parts = [u.netloc.replace(":", "_") or "local"]
    for p in urllib.parse.unquote(u.path).split("/"):
        if p in ("", ".", ".."):
            continue
        parts.append(re.sub(r"[^\w.+=@,-]", "_", p))
    if len(parts) == 1:
        parts.append("index")
    if u.query:
        parts[-1] += "-" + hashlib.sha256(u.query.encode()).hexdigest()[:12]
    return parts


def cache_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the verified copy of ``url`` lives in the cache (whether or not it is there)."""
    return cache_dir(cache).joinpath("downloads", *_safe_parts(gs_to_https(url)))


def _side_path(url: str, cache: str | os.PathLike[str] | None, kind: str, suffix: str) -> Path:
    parts = _safe_parts(gs_to_https(url))
    parts[-1] += suffix
    return cache_dir(cache).joinpath("downloads", kind, *parts)


def partial_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    return _side_path(url, cache, ".partial", ".part")


def record_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    return _side_path(url, cache, ".records", ".json")


def read_record(url: str, cache: str | os.PathLike[str] | None = None) -> Record | None:
    """The download record (size, SHA-256, source) kept beside a cached file, or None if there is none or it
    is unreadable."""
    try:
        return Record(**json.loads(record_path(url, cache).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def is_cached(url: str, cache: str | os.PathLike[str] | None = None) -> bool:
    """Whether the file of ``url`` is complete in the cache (a ``.partial`` download does not count)."""
    return cache_path(url, cache).is_file()


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file as lowercase hex, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _write_record(path: Path, url: str, digest: str, published: bool, cache: str | os.PathLike[str] | None) -> None:
    st = path.stat()
    rec = Record(url=url, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, published_sha256=published)
    target = record_path(url, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=1) + "\n")
    os.replace(tmp, target)


def _check_cached(path: Path, url: str, sha256: str | None, cache: str | os.PathLike[str] | None) -> None:
    """Refuse a cached file that no longer matches what was recorded (or the published digest)."""
    rec = read_record(url, cache)
    st = path.stat()
    if rec is not None and rec.size == st.st_size and rec.mtime_ns == st.st_mtime_ns:
        digest = rec.sha256
    else:
        digest = sha256_file(path)
        if rec is not None and rec.sha256 != digest:
            raise DownloadError(
                f"{path}: cached file changed since it was downloaded (sha256 {digest[:16]}..., recorded "
                f"{rec.sha256[:16]}...); delete it and download again"
            )
    if sha256 and digest != sha256.lower():
        raise DownloadError(
            f"{path}: sha256 {digest} does not match the published {sha256.lower()}; delete it and download again"
        )
    if rec is None or rec.size != st.st_size or rec.mtime_ns != st.st_mtime_ns:
        _write_record(path, url, digest, bool(sha256), cache)


def _what_to_do(url: str) -> str:
    return f"download {url} yourself and pass its path"


def _request(url: str, start: int, timeout: float) -> http.client.HTTPResponse:
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and start:
            raise _RangeRefused() from None
        if e.code in (404, 410):
            raise DownloadError(f"{url}: not found (HTTP {e.code}); check the name or URL") from None
        if e.code in (401, 403):
            raise DownloadError(
                f"{url}: access denied (HTTP {e.code}); the file is not public: {_what_to_do(url)}"
            ) from None
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; try again later or {_what_to_do(url)}") from None
    except urllib.error.URLError as e:
        raise _network_error(url, e.reason, timeout) from None
    except (TimeoutError, OSError) as e:
        raise _network_error(url, e, timeout) from None


class _RangeRefused(Exception):
    pass


def _network_error(url: str, reason: object, timeout: float) -> DownloadError:
    if isinstance(reason, TimeoutError | socket.timeout):
        return DownloadError(f"{url}: timed out after {timeout:g} s; try again later or {_what_to_do(url)}")
    host = urllib.parse.urlsplit(url).netloc
    return DownloadError(f"{url}: cannot reach {host} ({reason}); offline? {_what_to_do(url)}")


def _disk_full(path: Path) -> DownloadError:
    return DownloadError(
        f"{path}: disk full; free some space, or put the cache on a larger disk with --cache-dir or {ENV_VAR}"
    )


def _content_range(resp: http.client.HTTPResponse) -> tuple[int, int | None]:
    """(first byte, total size or None) of a 206 response."""
    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", ""))
    if not m:
        return -1, None
    return int(m.group(1)), None if m.group(2) == "*" else int(m.group(2))


def _fetch(url: str, part: Path, timeout: float, retries: int, progress: bool, label: str) -> None:
    """Fill ``part`` with the whole body of ``url``, resuming after cuts; raises DownloadError."""
    attempts = 0
    bar: tqdm | None = None
    try:
        while True:
            start = part.stat().st_size if part.exists() else 0
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
                    start = 0
                    length = resp.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                if total is not None:
                    free = shutil.disk_usage(part.parent).free
                    if total - start > free:
                        raise _disk_full(part.parent)
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
                    with open(part, "ab" if start else "wb") as f:
                        while block := resp.read(CHUNK):
                            f.write(block)
                            got += len(block)
                            bar.update(len(block))
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise _disk_full(part.parent) from None
                    if isinstance(e, TimeoutError | ConnectionError):
                        cut: Exception | None = e
                    else:
                        raise DownloadError(f"{part}: cannot write ({e.strerror or e})") from None
                except http.client.IncompleteRead as e:
                    cut = e
                else:
                    cut = None
                if cut is None and (total is None or got == total):
                    return
                if cut is None and total is not None and got > total:
                    part.unlink()
                    raise DownloadError(f"{url}: server sent {got} bytes for a {total}-byte file; try again later")
            attempts += 1
            if attempts > retries:
                raise DownloadError(
                    f"{url}: connection cut after {got} of {total if total is not None else '?'} bytes "
                    f"({attempts} attempts); run the command again to resume, or {_what_to_do(url)}"
                )
            time.sleep(min(0.2 * attempts, 2.0))
    finally:
        if bar is not None:
            bar.close()


def download(
    url: str,
    *,
    cache: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    progress: bool = True,
    timeout: float = 30.0,
    retries: int = 5,
) -> Path:
    """A verified local copy of ``url`` (``http(s)://`` or ``gs://``), downloaded once into the cache."""
    url = gs_to_https(url)
    final = cache_path(url, cache)
    if final.is_file():
        _check_cached(final, url, sha256, cache)
        return final
    part = partial_path(url, cache)
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        lock_name = hashlib.sha256(url.encode()).hexdigest()[:24] + ".lock"
        lock_path = cache_dir(cache) / "downloads" / ".locks" / lock_name
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(part.parent) from None
        raise DownloadError(f"{cache_dir(cache)}: cannot create the cache ({e.strerror or e}); "
                            f"choose another with --cache-dir or {ENV_VAR}") from None  # fmt: skip
    with FileLock(str(lock_path)):
        if final.is_file():  # another process finished it while we waited
            _check_cached(final, url, sha256, cache)
            return final
        _fetch(url, part, timeout, retries, progress, final.name)
        digest = sha256_file(part)
        if sha256 and digest != sha256.lower():
            part.unlink()
            raise DownloadError(
                f"{url}: sha256 {digest} does not match the published {sha256.lower()}; the download was "
                f"discarded (a changed or corrupted file); {_what_to_do(url)} if you trust it"
            )
        os.replace(part, final)
        fsync(final.parent)
        _write_record(final, url, digest, bool(sha256), cache)
    return final
