"""Crash-safe file replacement shared by every writer of vitkit: outputs, reports, logs and checkpoints.

Rules every writer follows (README: "never delete or overwrite what vitkit did not write"):

- every file is written by :func:`write_file_atomic` (every folder by :func:`write_dir_atomic`): into a new
  private folder beside it (mode 0700, a name vitkit marks as its own, ``.NAME.vitkit-tmp-`` and 16 random hex
  digits), flushed to disk, and moved into place by rename, so a reader never sees a half-written file; a file
  or folder finished elsewhere (a download's resumable partial file, a sweep's winning run) is put in place by
  :func:`publish` (flushed, then renamed). No other module renames a file into place itself;
- never through a symbolic link: a destination that is a link (dangling or not), a FIFO, a device or a folder
  is refused with one line naming it (:func:`refuse_link`), checked again right before the rename; the rename
  itself replaces a name and never follows one; writers that append (a run's CSV logs) open the file
  without following links (:func:`open_append`);
- an existing folder is replaced only when vitkit wrote it (every entry is a file vitkit writes there, and
  the weights carry vitkit's marker) and the caller asked to replace it (``overwrite=True`` / ``--overwrite``);
  an existing file likewise only with ``overwrite``; an output never overlaps the input it was made from;
- every file of a checkpoint (weights, config, class names; training states and exports too) gets one mode:
  that of a new file under the process's umask, ``0666 & ~umask`` (0644 under the usual 022, 0600 under
  077; :func:`file_mode`), whatever the library that wrote it chose (safetensors' ``save_file`` makes
  0600 files), so whoever can read a checkpoint's config can read its weights; folders get ``0777 & ~umask``;
- vitkit's temporary names are its own: ``.NAME.vitkit-{tmp,old,del}-`` and 16 random hex digits
  (:func:`temp_path`), never a name a user would pick; replacing a folder takes two renames (old aside to
  ``.NAME.vitkit-old-...``, new into place); readers that find no ``NAME`` use that (:func:`complete_dir`), and
  :func:`clean_stale` restores or removes such leftovers (only names of that exact shape, owned by this user)
  the next time vitkit starts on that folder. A user's ``.NAME.old`` or ``.NAME.tmp-1234abcd`` is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from vitkit.errors import CheckpointError, ConfigError

WRITER_KEY = "vitkit.writer"  # safetensors metadata key marking a file vitkit wrote
WRITER = "vitkit"
_TEMP = re.compile(r"^\.(?P<name>.+)\.vitkit-(?P<kind>tmp|old|del)-[0-9a-f]{16}$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux's /proc/self/status);
    elsewhere set and restored at once (which briefly affects files other threads create)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of every file vitkit writes into a checkpoint: ``0666 & ~umask``."""
    return 0o666 & ~umask()


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(target: Path, kind: str = "tmp") -> Path:
    """A hidden sibling name of ``target`` marked as vitkit's own and unguessable (``.NAME.vitkit-KIND-`` and
    16 random hex digits), which :func:`clean_stale` recognises as a leftover."""
    return target.with_name(f".{target.name}.vitkit-{kind}-{secrets.token_hex(8)}")


def temp_target(name: str, kind: str | None = None) -> str | None:
    """``NAME`` for a name :func:`temp_path` makes (of ``kind``, when given), else None."""
    m = _TEMP.match(name)
    return m.group("name") if m and (kind is None or m.group("kind") == kind) else None


def _mine(path: Path) -> bool:
    """Whether ``path`` is a file or folder (not a link) owned by this user: the only leftovers vitkit touches."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()


def remove_tree(path: Path) -> None:
    """Delete a folder vitkit wrote: renamed to a hidden name first, so a kill mid-way leaves no partial
    folder under its real name (the hidden rest is cleaned by :func:`clean_stale`)."""
    if not path.exists() or path.is_symlink():
        return
    try:
        doomed = set_aside(path)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def set_aside(path: Path) -> Path:
    """Rename ``path`` (a file or folder vitkit wrote, about to be deleted) to a hidden ``.NAME.vitkit-del-...``
    name and return that: a kill while it is deleted leaves nothing partial under its real name, and
    :func:`clean_stale` removes the rest."""
    doomed = temp_path(path, "del")
    os.replace(path, doomed)
    return doomed


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst`` by renames only. An existing ``dst`` is first renamed aside
    to ``.dst.vitkit-old-...`` and removed after the new one is in place, so at every instant one complete
    version exists on disk: ``dst`` itself or, between the two renames, the aside (which :func:`complete_dir`
    finds). A ``dst`` that is a link, or not a folder, is refused."""
    refuse_link(dst)
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    old = temp_path(dst, "old") if dst.exists() else None
    if old is not None:
        os.replace(dst, old)
    os.replace(src, dst)
    with contextlib.suppress(OSError):
        fsync(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_dir(path: Path) -> Path:
    """``path``, or the version a replace set aside when it was interrupted between its two renames (a
    ``.NAME.vitkit-old-...`` folder of this user's that a kill left; the first by name)."""
    if os.path.lexists(path) or not path.parent.is_dir():
        return path
    found = [e for e in path.parent.iterdir() if temp_target(e.name, "old") == path.name]
    return min((e for e in found if _mine(e) and e.is_dir()), default=path)


def clean_stale(folder: Path, names: Iterable[str] | None = None) -> list[str]:
    """Undo what a kill left in ``folder``: ``.NAME.vitkit-old-...`` is renamed back to ``NAME`` when ``NAME``
    is missing (otherwise removed); ``.NAME.vitkit-tmp-...`` / ``.NAME.vitkit-del-...`` are removed. Only names
    of exactly that shape (for ``names`` only, when given), owned by this user and not links, are touched.
    Returns what was done, for a note."""
    done: list[str] = []
    if not folder.is_dir():
        return done
    wanted = None if names is None else set(names)
    for entry in sorted(folder.iterdir()):
        m = _TEMP.match(entry.name)
        if not m or (wanted is not None and m.group("name") not in wanted) or not _mine(entry):
            continue
        real = folder / m.group("name")
        if m.group("kind") == "old" and entry.is_dir() and not os.path.lexists(real):
            os.replace(entry, real)
            done.append(f"restored {real.name} from an interrupted replace")
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry.name}")
        else:
            entry.unlink(missing_ok=True)
            done.append(f"removed {entry.name}")
    return done


# ---- never through a link ------------------------------------------------------------------------------


def refuse_link(path: Path, option: str = "", *, dir_fd: int | None = None) -> None:
    """ConfigError naming ``path`` when it is a symbolic link (dangling or not) or exists and is neither a
    regular file nor a folder: an output is never written through a link, into a FIFO or a device. ``dir_fd``:
    ``path.name`` is looked up in the folder open as that descriptor."""
    where = f"{option} {path}" if option else str(path)
    try:
        st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False) if dir_fd is not None else os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{where}: cannot be checked ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"{where}: is a symbolic link; vitkit never writes through links (remove it, or name another path)"
        )
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where}: is not a regular file (a FIFO, socket or device); choose another path")


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def create_new(path: Path) -> BinaryIO:
    """A new file at ``path`` opened for writing: created here (``O_EXCL``), never through a symbolic link; an
    existing entry of any kind (a link planted since it was checked included) is ConfigError naming it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)
    except FileExistsError:
        raise ConfigError(f"--out {path}: appeared while vitkit was writing it (another process?); untouched") from None
    return os.fdopen(fd, "wb")


def open_regular(path: Path, option: str = "--out", *, write: bool = True, append: bool = False) -> BinaryIO:
    """An existing regular file opened for reading (and, with ``write``, writing; ``append``: created when
    missing, every write at its end) without following a symbolic link and without blocking on a FIFO;
    ConfigError naming it for a link, a FIFO, a device or a folder."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC
    if append:
        flags |= os.O_APPEND | os.O_CREAT
    where = f"{option} {path}" if option else str(path)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise ConfigError(f"{where}: is a symbolic link; vitkit never writes through links") from None
        raise ConfigError(f"{where}: cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{where}: is not a regular file (a FIFO, socket, device or folder)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, ("a+b" if append else "r+b") if write else "rb")


def open_append(path: Path) -> BinaryIO:
    """A log file (a run's CSV logs) opened to append to, created when missing, never through a link."""
    return open_regular(path, "", append=True)


# ---- refusing to clobber ------------------------------------------------------------------------------


def safetensors_marked(path: Path) -> bool:
    """Whether a .safetensors file carries vitkit's writer mark (reads only its header)."""
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100_000_000:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get(WRITER_KEY) == WRITER


@contextlib.contextmanager
def write_errors(target: Path) -> Iterator[None]:
    """Turn a failed write (disk full, read-only file system, no permission; safetensors' own I/O errors
    included) into one CheckpointError naming ``target``. The writers all go through a temporary name, so
    whatever ``target`` held before is still there."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        reason = reason.removeprefix("Error while serializing: ")
        raise CheckpointError(f"{target}: cannot write ({reason}); its previous contents, if any, are kept") from None


def _private_dir(parent: int, target: Path) -> tuple[str, int]:
    """(name, descriptor) of a new private folder (0700, a :func:`temp_path` name) in the folder open as
    ``parent``, opened without following links and checked to be the one made here (owned by this user, private)."""
    while True:
        name = temp_path(target).name
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
            break
    fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise ConfigError(f"{target.parent}: another process swapped vitkit's temporary folder there; nothing written")
    return name, fd


def _where(fd: int, fallback: Path) -> Path:
    """A path to the folder open as ``fd`` that no rename of its name can redirect (Linux's
    ``/proc/self/fd/N``), else ``fallback``."""
    proc = Path(f"/proc/self/fd/{fd}")
    return proc if proc.is_dir() else fallback


def _finish_files(tmp: int, parent: int, out: Path) -> None:
    """Every regular file the writer left in the private folder ``tmp``: given :func:`file_mode`, flushed to
    disk, and renamed into ``out``'s folder (``out`` itself last, its companions first), each destination
    checked not to be a link right before its rename; anything else the writer left is refused."""
    names = sorted(os.listdir(tmp), key=lambda n: n == out.name)
    if out.name not in names:
        raise CheckpointError(f"{out}: the writer produced no file")
    mode = file_mode()
    for name in names:
        _seal(name, mode, f"{out}: the writer left {name!r}, which is not a regular file", dir_fd=tmp)
    for name in names:
        refuse_link(out.parent / name, dir_fd=parent)  # again right here: a link planted since is refused
        os.replace(name, name, src_dir_fd=tmp, dst_dir_fd=parent)  # replaces a name, never follows one
    with contextlib.suppress(OSError):
        os.fsync(parent)


def _seal(path: str | Path, mode: int, refusal: str, *, dir_fd: int | None = None) -> None:
    """Give the regular file ``path`` (opened without following a link) ``mode`` and flush it to disk; anything
    else is CheckpointError(``refusal``)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(refusal)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_private(tmp: int, parent: int, name: str) -> None:
    """Remove the private folder ``name`` (open as ``tmp``) and what is still in it: only vitkit made it."""
    for entry in os.listdir(tmp):
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.stat(entry, dir_fd=tmp, follow_symlinks=False).st_mode):
                shutil.rmtree(entry, dir_fd=tmp, ignore_errors=True)
            else:
                os.unlink(entry, dir_fd=tmp)
    os.close(tmp)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)


def write_file_atomic(out: Path, write: Callable[[Path], object]) -> Path:
    """The one way vitkit writes a file: ``write(tmp)`` writes ``tmp``, a path named like ``out`` inside a new
    private folder beside it (0700, vitkit's own unguessable name; on Linux reached through the folder's open
    descriptor, so nothing can redirect it); the file is then flushed to disk, given :func:`file_mode` and
    renamed onto ``out`` (a crash leaves the old file). A companion file the writer puts beside ``tmp`` (an
    ONNX model's external data) is moved beside ``out`` first. ``out`` -- or a companion's name -- that is a
    symbolic link (dangling or not), a FIFO, a device or a folder is refused with one line naming it, before
    and again right before the rename: never followed, the file it points to untouched."""
    refuse_link(out)
    if out.is_dir():
        raise ConfigError(f"{out}: is a folder; vitkit writes a file there only in place of a file")
    with write_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(out.parent, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        try:
            name, tmp = _private_dir(parent, out)
            try:
                write(_where(tmp, out.parent / name) / out.name)
                _finish_files(tmp, parent, out)
            finally:
                _drop_private(tmp, parent, name)
        finally:
            os.close(parent)
    return out


def write_text_atomic(out: Path, text: str) -> Path:
    """``text`` (UTF-8) written to ``out`` by :func:`write_file_atomic`."""
    return write_file_atomic(out, lambda tmp: tmp.write_bytes(text.encode("utf-8")))


def publish(src: Path, dst: Path) -> None:
    """Put a finished file or folder that vitkit wrote elsewhere in place of ``dst`` (a download's resumable
    partial file, the winning run of a sweep): a file is flushed to disk and given :func:`file_mode`, then renamed
    onto ``dst`` (a crash leaves ``dst`` as it was); a folder is swapped in by :func:`replace_dir`. A ``dst``
    that is a symbolic link, a FIFO or a device is refused with one line naming it, right before the rename: a
    rename replaces a name and never writes through one. Files written now go through
    :func:`write_file_atomic` instead."""
    if src.is_dir() and not src.is_symlink():
        replace_dir(src, dst)
        return
    _seal(src, file_mode(), f"{src}: is not a regular file; vitkit puts only its own files in place")
    refuse_link(dst)
    if dst.is_dir():
        raise ConfigError(f"{dst}: is a folder; vitkit puts a file there only in place of a file")
    os.replace(src, dst)
    with contextlib.suppress(OSError):
        fsync(dst.parent)


def write_dir_atomic(out: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a new private folder beside ``out`` (reached, on Linux, through its open descriptor),
    fsync what it wrote, give it the folder mode and swap it in for ``out`` with :func:`replace_dir` (at every
    instant one complete version is on disk; a link at ``out`` is refused); a failed write is one
    CheckpointError naming ``out`` (:func:`write_errors`) and leaves no temporary folder."""
    refuse_link(out)
    with write_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:  # a new empty private folder beside it: the same file system, so the rename is atomic
            tmp = temp_path(out)
            with contextlib.suppress(FileExistsError):
                tmp.mkdir(mode=0o700)
                break
        try:
            fd = os.open(tmp, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
            try:
                write(_where(fd, tmp))
            finally:
                os.close(fd)
            mode = file_mode()
            for f in tmp.rglob("*"):  # every file under it gets the file mode
                if f.is_file() and not f.is_symlink():
                    os.chmod(f, mode)
            for f in tmp.iterdir():  # its files and the folder itself flushed to disk
                if f.is_file():
                    fsync(f)
            fsync(tmp)
            os.chmod(tmp, 0o777 & ~umask())
            replace_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
