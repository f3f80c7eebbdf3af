"""Downloads that never hand over a bad file.

``download(url)`` returns the path of a complete, verified copy of ``url`` in the cache (the HTTP transfer
itself is :mod:`vitkit.hub.transfer`):

- the bytes go to ``<cache>/downloads/.partial/...`` and are renamed into place only once complete and
  checked, so the cache never serves a partial or corrupt file;
- a connection cut mid-body is resumed with an HTTP ``Range`` request (within the call, and by the next
  call from the partial file it left);
- the SHA-256 is checked against a published digest when one is given and recorded on first download
  otherwise (``<cache>/downloads/.records/...json``, with the URL it was downloaded from); a cached file whose
  size or time stamp changed since is re-hashed and refused if it no longer matches, and one whose record names
  another URL is refused;
- a download is at most :data:`MAX_DOWNLOAD_BYTES` (or ``max_bytes``): a larger announced size is refused
  before anything is written, and a body that runs past it is cut there and refused; a redirect from
  ``https`` to plain ``http`` is refused (the bytes would come unauthenticated);
- failures (offline, 404, timeout, disk full, wrong digest) are one-line :class:`DownloadError`\\ s that say
  what to do, e.g. download the file yourself and pass its path.

**Where a URL is kept.** ``downloads/<host>[_<port>]/<folders of the URL path>/<name>@<digest>/<name>``: the
host and path stay readable (``find ~/.cache/vitkit/downloads -name ViT-B_16.npz`` finds a file), characters
other than letters, digits and ``.+=,-`` become ``_``, and ``<digest>`` (the first 32 hex digits of the SHA-256
of the whole URL: scheme, host, port, percent-encoding, query) makes the name of every URL its own --
``http://h/a%20b``, ``http://h/a_b`` and ``https://h/a_b`` are three entries. ``@`` appears in no readable part,
so no URL's folders can run into another URL's entry. A host of ``.`` or ``..`` (or any starting with a dot) is
refused. Entries of the layout before this one (``downloads/<host>/<path>``, without the digest) are moved to
their new name the first time their URL is asked for, if their record names exactly that URL (the file was
downloaded from it) and the move is possible; otherwise they are left alone and the URL is downloaded again
(old entries no URL asks for any more, and old ``.partial`` files, may be deleted by hand).

**Who can write there.** What is cached is loaded as weights, so the cache is used only where no other local
user can change it (:func:`vitkit.hub.cache.untrusted`: every folder on the way owned by this user or root and
writable by no one else); missing folders are created with mode 0700. Partial and temporary files are opened
with ``O_NOFOLLOW`` (and ``O_EXCL`` when new), and a symbolic link where vitkit expects its own file is refused
rather than written through. A cache that is read-only (a copied cache, a read-only mount) still serves what
it holds: a record that cannot be written is a warning on the ``vitkit.hub`` logger, and only a download that
cannot be stored is an error.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from vitkit.errors import VitkitError
from vitkit.fileio import is_regular, publish, write_text_atomic
from vitkit.hub.cache import ENV_VAR, cache_dir, private_dirs, untrusted
from vitkit.hub.transfer import (
    CHUNK,
    MAX_DOWNLOAD_BYTES,
    NOFOLLOW,
    DownloadError,
    disk_full,
    fetch,
    regular_file,
    what_to_do,
)

DIGEST_CHARS = 32  # of the URL's SHA-256 in its cache entry's name (128 bits: no two URLs meet by chance)
MAX_SEGMENT = 100  # readable characters kept of one URL path segment (the digest keeps names unique)
_UNSAFE = re.compile(r"[^\w.+=,-]")  # no "@": it marks the digest folders

logger = logging.getLogger("vitkit.hub")


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


def _readable(segment: str) -> str:
    """A URL path segment as a file name: unusual characters to ``_``, a long one cut in its middle."""
    text = _UNSAFE.sub("_", segment)
    return text if len(text) <= MAX_SEGMENT else text[: MAX_SEGMENT // 2] + "_" + text[-(MAX_SEGMENT // 2 - 1) :]


def split_url(url: str) -> urllib.parse.SplitResult:
    """``url`` split into its parts; DownloadError for one that no request could carry: a character outside
    printable ASCII (a space, a control character: percent-encode them), or one ``urlsplit`` refuses (an
    unclosed ``[`` of an IPv6 host)."""
    bad = next((c for c in url if not " " < c < "\x7f"), None)
    if bad is not None:
        raise DownloadError(f"{url!r}: not a valid URL (it contains {bad!r}; percent-encode such characters)")
    try:
        return urllib.parse.urlsplit(url)
    except ValueError as e:  # "Invalid IPv6 URL"
        raise DownloadError(f"{url}: not a valid URL ({e})") from None


def _host(url: str) -> str:
    """The readable host folder of ``url``: ``host`` or ``host_port`` (never credentials); DownloadError for
    a URL without a usable host."""
    u = split_url(url)
    try:
        host, port = u.hostname, u.port
    except ValueError as e:  # a port that is not a number
        raise DownloadError(f"{url}: not a valid URL ({e})") from None
    if not host:
        raise DownloadError(f"{url}: not a valid URL (no host)")
    name = _UNSAFE.sub("_", host)
    if name.startswith("."):  # "." and ".." would climb out of downloads/; ".partial" is vitkit's own
        raise DownloadError(f"{url}: {host!r} is not a host name")
    return name if port is None else f"{name}_{port}"


def _entry_parts(url: str) -> list[str]:
    """Cache-relative path of ``url``: host, the URL path's folders, ``<name>@<digest>``, ``<name>`` (see the
    module's docstring). Injective: the digest covers the whole URL."""
    segments = [_readable(p) for p in urllib.parse.unquote(split_url(url).path).split("/")]
    folders = [p for p in segments if p not in ("", ".", "..")]
    name = folders.pop() if folders else "index"
    digest = hashlib.sha256(url.encode()).hexdigest()[:DIGEST_CHARS]
    return [_host(url), *folders, f"{name}@{digest}", name]


def _downloads(cache: str | os.PathLike[str] | None) -> Path:
    return cache_dir(cache) / "downloads"


def cache_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the verified copy of ``url`` lives in the cache (whether or not it is there)."""
    return _downloads(cache).joinpath(*_entry_parts(gs_to_https(url)))


def _side_path(url: str, cache: str | os.PathLike[str] | None, kind: str, suffix: str) -> Path:
    parts = _entry_parts(gs_to_https(url))
    parts[-1] += suffix
    return _downloads(cache).joinpath(kind, *parts)


def partial_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    return _side_path(url, cache, ".partial", ".part")


def record_path(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    return _side_path(url, cache, ".records", ".json")


def _read_json(path: Path) -> Record | None:
    """The record at ``path`` (not through a symbolic link), None if missing or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return Record(**json.loads(f.read(1 << 20)))
    except (OSError, ValueError, TypeError):
        return None


def read_record(url: str, cache: str | os.PathLike[str] | None = None) -> Record | None:
    """The download record (size, SHA-256, source) kept beside a cached file, or None if there is none or it
    is unreadable."""
    return _read_json(record_path(gs_to_https(url), cache))


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
    """Record ``path`` as the copy of ``url``. A record that cannot be written (a read-only cache) is a warning:
    the file is still good, it is only hashed again the next time."""
    st = path.stat()
    rec = Record(url=url, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, published_sha256=published)
    target = record_path(url, cache)
    try:
        _private_folder(target.parent, cache)
        _put_json(target, asdict(rec))
    except (OSError, VitkitError) as e:
        logger.warning(
            "vitkit.hub: %s: cannot record the download (%s); using it anyway (it is hashed again next time)",
            target,
            e.strerror if isinstance(e, OSError) and e.strerror else e,
        )


def _put_json(target: Path, doc: dict[str, object]) -> None:
    """Write ``doc`` to ``target`` by :func:`~vitkit.fileio.write_text_atomic` (never through a link)."""
    write_text_atomic(target, json.dumps(doc, indent=1) + "\n")


def _check_private(folder: Path, cache: str | os.PathLike[str] | None, sticky_ok: bool = False) -> None:
    """DownloadError unless only this user (or root) can change ``folder`` and the folders above it."""
    why = untrusted(folder, sticky_ok=sticky_ok)
    if why is not None:
        raise DownloadError(
            f"{why}: other users could swap the files in {_downloads(cache)} or redirect what vitkit writes there; "
            f"make it private (chmod go-w) or choose another cache with --cache-dir or {ENV_VAR}"
        )


def _private_folder(folder: Path, cache: str | os.PathLike[str] | None) -> None:
    """Create ``folder`` (missing parts with mode 0700) where no other user can change it: the deepest existing
    folder is checked before anything is created in it, and ``folder`` itself after. DownloadError otherwise."""
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    _check_private(existing, cache, sticky_ok=existing != folder)
    try:
        private_dirs(folder)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise disk_full(folder) from None
        raise _cannot_store(cache, e) from None
    _check_private(folder, cache)


def _check_cached(path: Path, url: str, sha256: str | None, cache: str | os.PathLike[str] | None) -> None:
    """Refuse a cached file that no longer matches what was recorded (or the published digest), or that was
    recorded for another URL."""
    _check_private(path.parent, cache)
    regular_file(path)
    rec = read_record(url, cache)
    if rec is not None and rec.url != url:
        raise DownloadError(f"{path}: cached for another URL ({rec.url}), not {url}; delete it and download again")
    st = path.stat()
    fresh = rec is not None and (rec.size, rec.mtime_ns) == (st.st_size, st.st_mtime_ns)  # hashed as recorded
    digest = rec.sha256 if rec is not None and fresh else sha256_file(path)
    if rec is not None and rec.sha256 != digest:
        raise DownloadError(
            f"{path}: cached file changed since it was downloaded (sha256 {digest[:16]}..., recorded "
            f"{rec.sha256[:16]}...); delete it and download again"
        )
    if sha256 and digest != sha256.lower():
        raise DownloadError(
            f"{path}: sha256 {digest} does not match the published {sha256.lower()}; delete it and download again"
        )
    if not fresh:
        _write_record(path, url, digest, bool(sha256), cache)


def _legacy_parts(url: str) -> list[str]:
    """Cache-relative path of ``url`` in the layout before the digest (kept to move such entries)."""
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


def _adopt_legacy(url: str, final: Path, cache: str | os.PathLike[str] | None) -> None:
    """Move ``url``'s entry of the earlier layout (and its record) to ``final``, if there is one, it is a
    regular file and its record names exactly ``url``; otherwise leave everything as it is."""
    parts = _legacy_parts(url)
    downloads = _downloads(cache)  # no part climbs out: "."/".." path segments are dropped, such hosts refused
    old, old_record = downloads.joinpath(*parts), downloads.joinpath(".records", *parts[:-1], parts[-1] + ".json")
    if not is_regular(old):
        return
    rec = _read_json(old_record)
    if rec is None or rec.url != url or untrusted(old.parent) or untrusted(old_record.parent):
        return
    target = record_path(url, cache)
    try:
        _private_folder(final.parent, cache)
        _private_folder(target.parent, cache)
        publish(old, final)  # the time stamp moves with it: the record still matches
        _put_json(target, asdict(rec))
        old_record.unlink()
    except (OSError, VitkitError):
        return  # a read-only cache: the old entry stays where it is; the URL is downloaded anew


def download(
    url: str,
    *,
    cache: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    progress: bool = True,
    timeout: float = 30.0,
    retries: int = 5,
    max_bytes: int = MAX_DOWNLOAD_BYTES,
) -> Path:
    """A verified local copy of ``url`` (``http(s)://`` or ``gs://``), downloaded once into the cache; at most
    ``max_bytes`` long (DownloadError otherwise, and nothing is kept)."""
    url = gs_to_https(url)
    final = cache_path(url, cache)
    if not regular_file(final):
        _adopt_legacy(url, final, cache)
    if regular_file(final):
        _check_cached(final, url, sha256, cache)
        return final
    part = partial_path(url, cache)
    lock_path = _downloads(cache) / ".locks" / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".lock")
    for folder in (part.parent, final.parent, lock_path.parent):
        _private_folder(folder, cache)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire()
    except OSError as e:
        raise _cannot_store(cache, e) from None
    try:
        if regular_file(final):  # another process finished it while we waited
            _check_cached(final, url, sha256, cache)
            return final
        fetch(url, part, timeout, retries, progress, final.name, max_bytes)
        digest = sha256_file(part)
        if sha256 and digest != sha256.lower():
            part.unlink()
            raise DownloadError(
                f"{url}: sha256 {digest} does not match the published {sha256.lower()}; the download was "
                f"discarded (a changed or corrupted file); {what_to_do(url)} if you trust it"
            )
        publish(part, final)  # flushed, then renamed: a link planted at final is refused, never followed
        _write_record(final, url, digest, bool(sha256), cache)
    finally:
        lock.release()
    return final


def _cannot_store(cache: str | os.PathLike[str] | None, e: OSError) -> DownloadError:
    return DownloadError(
        f"{cache_dir(cache)}: cannot store downloads there ({e.strerror or e}); "
        f"choose another cache with --cache-dir or {ENV_VAR}"
    )
