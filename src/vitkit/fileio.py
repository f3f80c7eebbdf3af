"""Crash-safe file replacement shared by every writer of checkpoints and model folders.

Rules every writer follows (README: "never delete or overwrite what vitkit did not write"):

- an output is written under a hidden temporary name beside it (``.NAME.tmp-XXXXXXXX``), flushed, and moved
  into place by rename, so a reader never sees a half-written file or folder;
- an existing folder is replaced only when vitkit wrote it (every entry is a file vitkit writes there, and
  the weights carry vitkit's marker) and the caller asked to replace it (``overwrite=True`` / ``--overwrite``);
  an existing file likewise only with ``overwrite``; an output never overlaps the input it was made from;
- every file of a checkpoint (weights, config, class names; training states and exports too) gets one mode:
  that of a new file under the process's umask, ``0666 & ~umask`` (0644 under the usual 022, 0600 under
  077; :func:`file_mode`), whatever the library that wrote it chose (safetensors' ``save_file`` makes
  0600 files), so whoever can read a checkpoint's config can read its weights; folders get ``0777 & ~umask``;
- replacing a folder takes two renames (old aside to ``.NAME.old``, new into place); readers that find no
  ``NAME`` use ``.NAME.old`` (:func:`complete_dir`), and :func:`clean_stale` restores or removes such leftovers
  (only names of that exact shape, which only vitkit creates) the next time vitkit starts on that folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from vitkit.errors import CheckpointError, ConfigError

WRITER_KEY = "vitkit.writer"  # safetensors metadata key marking a file vitkit wrote
WRITER = "vitkit"
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp-[a-z0-9]{8}|old|del-[a-z0-9]{8})$")


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


def set_modes(path: Path) -> None:
    """Give ``path`` (a file) or every file under it (a folder) :func:`file_mode`."""
    mode = file_mode()
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for f in files:
        os.chmod(f, mode)


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _old(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.old")


def temp_path(target: Path, kind: str = "tmp") -> Path:
    """A hidden sibling name of ``target`` that :func:`clean_stale` recognises as vitkit's own leftover."""
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(4)}")


def make_temp_dir(target: Path) -> Path:
    """A new empty hidden folder beside ``target`` (same file system, so renaming it into place is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = temp_path(target)
        with contextlib.suppress(FileExistsError):
            tmp.mkdir()
            return tmp


def remove_tree(path: Path) -> None:
    """Delete a folder vitkit wrote: renamed to a hidden name first, so a kill mid-way leaves no partial
    folder under its real name (the hidden rest is cleaned by :func:`clean_stale`)."""
    if not path.exists():
        return
    doomed = temp_path(path, "del")
    try:
        os.replace(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def sync_tree(folder: Path) -> None:
    """fsync every file in ``folder`` and the folder itself."""
    for f in folder.iterdir():
        if f.is_file():
            fsync(f)
    fsync(folder)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst`` by renames only. An existing ``dst`` is first renamed aside
    to ``.dst.old`` and removed after the new one is in place, so at every instant one complete version exists
    on disk: ``dst`` itself or, between the two renames, ``.dst.old`` (which :func:`complete_dir` finds)."""
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    old = _old(dst)
    if dst.exists():
        if old.exists():  # a leftover from an earlier interrupted replace: dst is the complete one
            shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    with contextlib.suppress(OSError):
        fsync(dst.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def complete_dir(path: Path) -> Path:
    """``path``, or its ``.old`` version when a replace was interrupted between its two renames."""
    if not path.exists() and _old(path).is_dir():
        return _old(path)
    return path


def clean_stale(folder: Path, names: Iterable[str] | None = None) -> list[str]:
    """Undo what a kill left in ``folder``: ``.NAME.old`` is renamed back to ``NAME`` when ``NAME`` is missing
    (otherwise removed); ``.NAME.tmp-*`` / ``.NAME.del-*`` are removed. Only names of exactly that shape (for
    ``names`` only, when given) are touched. Returns what was done, for a note."""
    done: list[str] = []
    if not folder.is_dir():
        return done
    wanted = None if names is None else set(names)
    for entry in sorted(folder.iterdir()):
        m = _TEMP.match(entry.name)
        if not m or (wanted is not None and m.group("name") not in wanted) or entry.is_symlink():
            continue
        real = folder / m.group("name")
        if entry.name.endswith(".old") and entry.is_dir() and not real.exists():
            os.replace(entry, real)
            done.append(f"restored {real.name} from an interrupted replace")
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry.name}")
        else:
            entry.unlink(missing_ok=True)
            done.append(f"removed {entry.name}")
    return done


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


def overlaps(a: Path, b: Path) -> bool:
    """Whether one path is the other or lies inside it (after resolving links)."""
    ra, rb = a.resolve(), b.resolve()
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)


def check_not_input(out: Path, inputs: Iterable[str | os.PathLike[str] | None]) -> None:
    """Refuse an output that is, contains or lies inside an input it is made from."""
    for given in inputs:
        if given is None:
            continue
        src = Path(given)
        if src.exists() and overlaps(out, src):
            raise CheckpointError(f"{out}: the output would overwrite the input {src}; choose another output path")


def check_output_location(out: Path, *, inside: bool = False) -> None:
    """Can ``out`` be created (or, ``inside``, files be written into the folder ``out``)? The nearest folder that
    exists -- ``out`` itself when ``inside`` and it is one, else the nearest existing parent -- must be a folder
    this process may write into. A file there, or a read-only folder, would otherwise fail only when the work
    whose result goes there is done; every command checks its outputs with this before any work."""
    where = out if inside and out.is_dir() else None
    if where is None:
        for parent in out.absolute().parents:  # nearest first ("a/b/c" -> a/b, a, ...)
            if parent.exists() or parent.is_symlink():
                where = parent
                break
    if where is None:
        return
    if not where.is_dir():
        raise ConfigError(f"{out}: {where} is a file, not a folder; choose another output path")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"{out}: cannot write in {where} (no permission, or a read-only file system)")


def check_output_dir(
    out: Path, *, allowed: Iterable[str], owned: Callable[[Path], bool], overwrite: bool, what: str
) -> None:
    """May ``out`` be (re)written as a folder? Missing or empty: yes. Otherwise only a folder vitkit wrote
    (``owned``, and every entry in ``allowed``), and only with ``overwrite``."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CheckpointError(f"{out}: exists and is not a folder; choose another output path")
    check_output_location(out)  # written beside it, then renamed into place
    if not out.exists():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    allow = set(allowed)
    foreign = [e for e in entries if e not in allow]
    if foreign or not owned(out):
        why = f"it holds {foreign[0]!r}, which vitkit did not write" if foreign else f"it is not a {what} vitkit wrote"
        raise CheckpointError(f"{out}: not an empty folder ({why}); vitkit never deletes what it did not write")
    if not overwrite:
        raise CheckpointError(f"{out}: already holds a {what}; pass --overwrite (overwrite=True) to replace it")


def check_output_file(out: Path, *, overwrite: bool) -> None:
    """May ``out`` be (re)written as a file? Missing: yes; an existing file only with ``overwrite``."""
    if out.is_dir():
        raise CheckpointError(f"{out}: is a folder; name a file")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists; pass --overwrite (overwrite=True) to replace it")
    check_output_location(out)  # written beside it, then renamed into place


def check_report_dir(out: Path, names: Callable[[str], bool], json_key: tuple[str, str], what: str) -> None:
    """May report files be written into ``out``? A missing or empty folder, or one holding only files of an
    earlier report (``names``; its JSON file ``json_key[0]`` must hold the key ``json_key[1]``)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder; --out names a folder")
    check_output_location(out, inside=True)
    if not out.is_dir():
        return
    for entry in sorted(out.iterdir()):
        ours = names(entry.name) and entry.is_file()
        if ours and entry.name == json_key[0]:
            try:
                doc = json.loads(entry.read_text())
            except (OSError, ValueError):
                doc = None
            ours = isinstance(doc, dict) and json_key[1] in doc
        if not ours:
            raise ConfigError(
                f"{out}: holds {entry.name!r}, which is not from a {what}; choose an empty or new --out folder "
                "(vitkit never overwrites what it did not write)"
            )


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


def write_file_atomic(out: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` to a hidden sibling, flush, and rename it onto ``out`` (a crash leaves the old file)."""
    with write_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(out)
        try:
            write(tmp)
            set_modes(tmp)
            fsync(tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def write_dir_atomic(out: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a new hidden folder beside ``out``, fsync what it wrote, and swap it in for ``out``
    with :func:`replace_dir` (at every instant one complete version is on disk); a failed write is one
    CheckpointError naming ``out`` (:func:`write_errors`) and leaves no temporary folder."""
    with write_errors(out):
        tmp = make_temp_dir(out)
        try:
            write(tmp)
            set_modes(tmp)
            sync_tree(tmp)
            replace_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- names as text -------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def text_id(name: str) -> str:
    """The one text form of an id (a path, shard member or row) in every output: valid UTF-8, each byte of a
    file name that is not UTF-8 written as ``\\xNN`` (Python's ``backslashreplace``), so CSV, Parquet and a
    strict console take it and a resume compares like with like."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    try:  # a non-UTF-8 file name, as Python's os functions give it (surrogateescape)
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # other lone surrogates
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def printable(text: str) -> str:
    """``text`` for a terminal: :func:`text_id`, and control characters (ESC, CR, newline...) as ``\\xNN``, so a
    file name can neither drive the terminal nor break a one-line message."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text_id(text))
