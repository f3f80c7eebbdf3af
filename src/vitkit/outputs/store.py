"""The one crash-safe chunk store under every resumable output (issue 33), and its rules (issue 32):

- **parts folder**: an output ``NAME`` is written chunk by chunk into ``NAME.parts/`` (:class:`Parts`), each
  chunk by :func:`~vitkit.fileio.write_file_atomic` (a private temporary folder, flushed to disk, renamed into
  place, never through a link), so neither a kill nor a power cut leaves a chunk half-written; the assembled file
  goes through the same helper;
- **delete only its own files**: the store removes only entries of its own shapes (its part names, their
  temporaries, its metadata file); a folder holding anything else is refused, not cleaned;
- **one pre-check** (:func:`precheck`), before any work: never through a symbolic link, into a FIFO or a folder;
  an existing output only with ``resume`` or ``overwrite``, and overwritten only when vitkit marked it;
- **one lock** (:class:`Locked`): one job writes an output at a time (``NAME.vitkit.lock``, until ``close``);
- **resume with metadata checks** (:func:`check_same`): the checkpoint, precision, preprocessing and input an
  output was made with must be this job's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from vitkit import fileio
from vitkit.errors import ConfigError, DataError
from vitkit.fileio import WRITER, WRITER_KEY, create_new, open_regular, set_aside, write_file_atomic
from vitkit.output_paths import check_output_location

CHECKPOINT, PRECISION, BACKEND, PREPROCESS, INPUT = (
    "vitkit.checkpoint", "vitkit.precision", "vitkit.backend", "vitkit.preprocess", "vitkit.input",
)  # fmt: skip
_NAMES = {CHECKPOINT: "checkpoint", PRECISION: "precision", BACKEND: "backend", PREPROCESS: "preprocessing",
          INPUT: "input"}  # fmt: skip
_W = TypeVar("_W", bound="Locked")
ROW_GROUP_BYTES = 64 << 20  # an assembled Parquet file's row groups: up to this much data each
RESUME_ADVICE = "continue it with the same checkpoint and options, or write to a new --out"


SIDECAR_MAX_BYTES = 1 << 20  # a mark file vitkit writes is a few hundred bytes


def sidecar_path(out: Path) -> Path:
    """The mark file beside an output that has no room for metadata of its own: ``out.jsonl.vitkit.json``."""
    return out.with_name(out.name + ".vitkit.json")


def read_sidecar(out: Path) -> dict[str, Any] | None:
    """The mark :func:`write_sidecar` left beside ``out`` (None when there is none, or it is not vitkit's)."""
    try:  # none there: open_regular's ConfigError, as for a link or a FIFO
        with open_regular(sidecar_path(out), write=False) as f:
            data = f.read(SIDECAR_MAX_BYTES + 1)
        doc = json.loads(data) if len(data) <= SIDECAR_MAX_BYTES else None
    except (ConfigError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get(WRITER_KEY) == WRITER else None


def write_sidecar(out: Path, doc: dict[str, Any]) -> None:
    """Mark ``out`` as vitkit's own: ``doc`` with the writer key, written to a temporary file and renamed (a
    planted link in its place is refused, never followed)."""
    fileio.write_text_atomic(sidecar_path(out), json.dumps({WRITER_KEY: WRITER, **doc}, sort_keys=True))


class OutputLock:
    """An exclusive lock on an output, held by this process for a whole job (``filelock``: ``flock`` on
    ``out.vitkit.lock``, opened without following links). A second job on the same output, in another process,
    is refused at once with one line naming it. Re-entrant in one process; :meth:`release` once per acquire.

    The lock file goes with the last release: it is unlinked while still locked, and a lock taken on a file
    that is no longer the one at its name (unlinked by the holder between our open and our ``flock``) is let
    go and taken again, so two jobs never both hold the output (a kill leaves the file: it holds nothing)."""

    def __init__(self, out: Path) -> None:
        from filelock import FileLock

        self.out = out
        self.path = out.with_name(out.name + ".vitkit.lock")
        fileio.refuse_link(self.path, "--out")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(os.fspath(self.path), is_singleton=True, thread_local=False)
        for _ in range(100):  # each retry follows a holder's release: a few at most
            self._acquire()
            if self.lock.lock_counter > 1 or self._holds_the_file():
                return
            self.lock.release()  # the holder removed the file we locked: the output is free, or taken anew
        raise DataError(
            f"--out {out}: another vitkit job keeps taking it; wait for it to end, or write to another --out"
        )

    def _acquire(self) -> None:
        from filelock import Timeout

        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            raise DataError(
                f"--out {self.out}: another vitkit job is writing it (it holds {self.path.name}); wait for it to end, "
                "or write to another --out"
            ) from None
        except OSError as e:
            raise ConfigError(f"--out {self.out}: cannot lock it through {self.path} ({e.strerror or e})") from None

    def _holds_the_file(self) -> bool:
        """Whether the file this process has locked is the one at the lock's name (True where that cannot be
        told: the file is then never removed)."""
        fd = getattr(getattr(self.lock, "_context", None), "lock_file_fd", None)
        if not isinstance(fd, int):
            return True
        try:
            held, named = os.fstat(fd), os.lstat(self.path)
        except OSError:
            return False
        return held.st_nlink > 0 and os.path.samestat(held, named)

    def release(self) -> None:
        """Let another job write the output (once per acquire; the process's exit releases it too); the last
        release removes the lock file (while it is still locked)."""
        if not self.lock.is_locked:
            return
        fd = getattr(getattr(self.lock, "_context", None), "lock_file_fd", None)
        if self.lock.lock_counter == 1 and isinstance(fd, int) and self._holds_the_file():
            with contextlib.suppress(OSError):
                self.path.unlink()
        self.lock.release()


def pyarrow() -> Any:
    """pyarrow, an optional dependency (ConfigError saying how to install it)."""
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(
            "--out *.parquet needs pyarrow: pip install 'vitkit[parquet]' (or pip install pyarrow)"
        ) from None
    return pyarrow


def output_suffix(path: str | os.PathLike[str], formats: Sequence[str]) -> str:
    """The format of an output by its suffix, one of ``formats``: ConfigError otherwise, and for Parquet without
    the optional pyarrow (refused here, before any image is read)."""
    suffix = Path(path).suffix.lower()
    if suffix not in formats:
        use = f"{', '.join(formats[:-1])} or {formats[-1]}"
        raise ConfigError(f"--out {path}: unknown format {suffix or '(no suffix)'!r}; use {use}")
    if suffix == ".parquet":
        pyarrow()
    return suffix


def parquet_marked(path: Path) -> bool:
    """Whether a Parquet file carries vitkit's writer mark in its schema metadata (False when unreadable)."""
    import pyarrow.parquet as pq

    try:
        with open_regular(path, write=False) as f:
            meta = pq.read_schema(f).metadata or {}
    except Exception:  # pyarrow raises ArrowInvalid, OSError...; ConfigError for a link
        return False
    return meta.get(WRITER_KEY.encode()) == WRITER.encode()


def write_parquet(out: Path, schema: Any, tables: Iterable[Any]) -> None:
    """``tables`` (pyarrow tables of ``schema``, e.g. one per chunk) streamed into one Parquet file ``out`` in row
    groups of up to :data:`ROW_GROUP_BYTES`, written under a temporary name and renamed into place."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema) as f:
            pending: list[Any] = []
            size, wrote = 0, False
            for table in tables:
                pending += table.to_batches()
                size += table.nbytes
                if size >= ROW_GROUP_BYTES:
                    f.write_table(pa.Table.from_batches(pending, schema))
                    pending, size, wrote = [], 0, True
            if pending or not wrote:
                f.write_table(pa.Table.from_batches(pending, schema))

    write_file_atomic(out, write)


class Parts:
    """A folder of numbered chunk files ``{prefix}NNNNNNNN{suffix}`` (``digits`` wide), and ``extra`` files of
    the store's own (its metadata). Chunks are written by :meth:`write` (temporary name, then rename)."""

    def __init__(
        self, folder: Path, suffix: str, *, prefix: str = "part-", digits: int = 8, extra: Sequence[str] = ()
    ) -> None:
        self.folder, self.suffix, self.prefix, self.digits, self.extra = folder, suffix, prefix, digits, set(extra)
        self.pattern = re.compile(rf"^{re.escape(prefix)}(\d{{{digits}}}){re.escape(suffix)}$")
        chunk = rf"\.{re.escape(prefix)}\d{{{digits}}}{re.escape(suffix)}"
        # a chunk being written: write_file_atomic's private folder (earlier versions: a file .NAME.tmp-XXXXXXXX)
        self.temporary = re.compile(rf"^{chunk}\.(?:vitkit-tmp-[0-9a-f]{{16}}|tmp(-[0-9a-f]{{8}})?)$")

    @classmethod
    def beside(cls, out: Path, suffix: str, extra: Sequence[str] = ()) -> Parts:
        """The parts folder of the output ``out``: ``NAME.parts/``."""
        return cls(out.with_name(out.name + ".parts"), suffix, extra=extra)

    def path(self, number: int) -> Path:
        return self.folder / f"{self.prefix}{number:0{self.digits}d}{self.suffix}"

    def names(self, temporary: bool = False) -> list[str]:
        """The chunk files (or their temporaries) in the folder, sorted; none when there is no folder."""
        if not self.folder.is_dir():
            return []
        return sorted(e.name for e in self.folder.iterdir() if self._ours(e, temporary))

    def _ours(self, e: Path, temporary: bool) -> bool:
        """A chunk file (``temporary``: a chunk being written, a file or a private folder) of this store."""
        if e.is_symlink() or not (self.temporary if temporary else self.pattern).match(e.name):
            return False
        return e.is_file() or (temporary and e.is_dir())

    def numbered(self) -> list[tuple[int, Path]]:
        """(number, path) of every complete chunk, in order."""
        return [(int(self.pattern.match(n).group(1)), self.folder / n) for n in self.names()]  # type: ignore[union-attr]

    def foreign(self) -> str | None:
        """The first entry of the folder the store did not write (a link, a folder, another name), if any."""
        if not os.path.lexists(self.folder):
            return None
        if not self.folder.is_dir():
            return "a file"
        for e in sorted(self.folder.iterdir(), key=lambda e: e.name):
            extra = e.name in self.extra and e.is_file() and not e.is_symlink()
            if not (self._ours(e, False) or self._ours(e, True) or extra):
                return e.name
        return None

    def drop_temporaries(self) -> None:
        """Remove chunks a kill cut mid-write (never renamed into place)."""
        for name in self.names(temporary=True):
            self._remove(self.folder / name)

    def _remove(self, entry: Path) -> None:
        """Remove a chunk, or a chunk being written (its private folder: the chunk file in it, then the folder)."""
        if entry.is_dir() and not entry.is_symlink():
            for inner in entry.iterdir():
                if self.pattern.match(inner.name) and not inner.is_symlink():
                    inner.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                entry.rmdir()
        else:
            entry.unlink(missing_ok=True)

    def write(self, number: int, write: Callable[[BinaryIO], object]) -> Path:
        """Chunk ``number`` written by ``write(file)`` through :func:`~vitkit.fileio.write_file_atomic` (a private
        temporary folder of its own: two processes filling one feature cache never share one; flushed to disk
        before it is renamed into place, replacing an earlier chunk of that number)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.path(number)

        def chunk(tmp: Path) -> None:
            with create_new(tmp) as f:
                write(f)

        return write_file_atomic(target, chunk)

    def clear(self, temporary: bool = True) -> None:
        """Remove every chunk (and, with ``temporary``, the chunks being written); anything else stays."""
        for name in self.names() + (self.names(temporary=True) if temporary else []):
            self._remove(self.folder / name)

    def discard(self) -> None:
        """Remove the folder: renamed aside first (a kill never leaves some of the chunks under its name), then
        only the store's own files are deleted; a folder still holding anything else is left (hidden)."""
        if not self.folder.is_dir():
            return
        aside = Parts(set_aside(self.folder), self.suffix, prefix=self.prefix, digits=self.digits,
                      extra=tuple(self.extra))  # fmt: skip
        aside.clear()
        for name in aside.extra:
            (aside.folder / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            aside.folder.rmdir()


def precheck(
    out: Path,
    parts: Parts,
    *,
    formats: str,
    resume: bool,
    overwrite: bool,
    sides: Sequence[Path] = (),
    ours: Callable[[Path], bool] | None,
) -> None:
    """May ``out`` be written (the one pre-check of every output, before any work)? New: yes. Existing (or a
    ``sides`` file, or its parts folder): only with ``resume`` or ``overwrite``. Never a link, FIFO, device or
    folder (``formats`` names the suffixes a file may have), nor a parts folder holding anything the store did not
    write; given ``ours``, an existing output that is not ``ours(out)`` is refused (where none is given, the
    reader's metadata check refuses it)."""
    fileio.refuse_link(out, "--out")
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; name a {formats} file")
    check_output_location(out)
    folder = parts.folder
    if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
        raise ConfigError(f"--out {folder}: is a symbolic link or not a folder; vitkit never writes through links")
    for side in sides:
        fileio.refuse_link(side, "--out")
    foreign = parts.foreign()
    if foreign is not None:
        raise ConfigError(
            f"--out {out}: {parts.folder} holds {foreign!r}, which vitkit did not write; vitkit never deletes what it "
            "did not write"
        )
    existing = [p for p in (out, *sides) if p.exists()]
    if (existing or parts.folder.exists()) and not (resume or overwrite):
        raise ConfigError(
            f"--out {out}: already exists (or a run into it was interrupted); pass --resume to continue it, or "
            "--overwrite to start again"
        )
    if existing and ours is not None and not ours(out):
        raise ConfigError(f"--out {existing[0]}: not written by vitkit; vitkit never overwrites what it did not write")


class Locked:
    """An output held by one job (:class:`OutputLock` on ``NAME.vitkit.lock``) from its opening
    to :meth:`close`: :meth:`locked` takes the lock before anything is looked at."""

    path: Path
    lock: OutputLock | None = None

    @staticmethod
    def locked(path: Path, opener: Callable[[], _W]) -> _W:
        """``opener()`` (the writer) run under a new lock on ``path``, which the writer then holds."""
        lock = OutputLock(path)  # a second job on this output is refused here
        try:
            writer = opener()
        except BaseException:
            lock.release()
            raise
        writer.lock = lock
        return writer

    def release(self) -> None:
        """Let another job write the output (:meth:`close` does it; an error's path calls this alone)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        """Finish the output (assemble its chunks), and let another job write it."""
        try:
            self._finish()
        finally:
            self.release()

    def _finish(self) -> None:
        raise NotImplementedError


def _show(key: str, value: str | None) -> str:
    if value is None:
        return "(not recorded)"
    return value[:12] if key == CHECKPOINT else value


def check_same(
    found: Mapping[str, str],
    wanted: Mapping[str, str],
    where: str,
    keys: tuple[str, ...] = (),
    advice: str = RESUME_ADVICE,
    against: str = "this run",
) -> None:
    """DataError naming ``where`` and the first of ``keys`` (default: every key of ``wanted``) whose value in
    ``found`` differs: the output was made with another checkpoint, precision, preprocessing or input."""
    for key in keys or tuple(wanted):
        if found.get(key) != wanted.get(key):
            name = _NAMES.get(key, key.removeprefix("vitkit.").replace("embed.", "--"))
            raise DataError(
                f"{where}: was made with {name} {_show(key, found.get(key))}, {against} with "
                f"{_show(key, wanted.get(key))}; {advice}"
            )
