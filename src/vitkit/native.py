"""Small C kernels compiled at run time by the system C compiler and loaded through ctypes.

Used by :mod:`vitkit.bench.peak` (the FMA-loop peak) and :mod:`vitkit.inference.fast` (the fused attention
kernel). A source is compiled once per content (source text, compiler and flags hash to the file name) into
``<cache>/native/`` -- the cache directory of :func:`vitkit.hub.cache.cache_dir` (``$VITKIT_HOME``, else
``$XDG_CACHE_HOME/vitkit``, else the platform's user cache) -- when that folder is safe to load code from: only
this user (or root) can change it or any folder on its path, no symbolic link on the way was made by another
user (:func:`vitkit.hub.cache.untrusted`), it can be written, and its mount allows executing code (not
``noexec``). Otherwise -- and when a library compiled there does not load -- the per-user folder
``vitkit-native-<uid>`` in the system temporary directory is used (under the same rule; it is created with mode
0700), and a warning on the ``vitkit.native`` logger says so once per process. Missing folders are created with
mode 0700. Concurrent processes are safe: each compiles into a private temporary name in the same directory
and renames it into place atomically, so a library is either absent or complete (two processes compiling at
once both produce the same file; the last rename wins).

Nothing here is required: :func:`load` returns ``None`` when there is no compiler, the CPU lacks a flag the
kernel needs, or compilation fails or hangs, and every caller keeps a pure-PyTorch path for that case. A compiler
that fails or hangs is reported once per source and process on the ``vitkit.native`` logger (a warning: with
logging not configured, Python writes it to stderr), with the command and the first lines of the compiler's
errors, so that a kernel that falls back says why; a missing compiler or CPU flag is a documented case and is
not reported. The compiler runs in a session of its own, so that a hung one is killed with everything it
started (``cc`` runs ``cc1`` and ``as`` as children, which outlive a kill of ``cc`` alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from vitkit import hardware
from vitkit.errors import VitkitError
from vitkit.fileio import write_file_atomic, write_text_atomic
from vitkit.hub.cache import cache_dir, private_dirs, untrusted

COMPILE_TIMEOUT_S = 120.0  # a kernel compiles in about a second; past this the pure-PyTorch path is taken
STDERR_LINES = 12  # of a failed compilation's errors, in the report; the first errors are the telling ones

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # what was reported in this process: failed builds (once per source), folders
_unloadable: set[Path] = set()  # folders where a library compiled in this process did not load
_reported_lock = threading.Lock()


def compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (the build convention; it may carry arguments, such as
    ``ccache gcc``), else ``cc``, ``gcc`` or ``clang`` on PATH."""
    try:
        wanted = shlex.split(os.environ.get("CC") or "")
    except ValueError:  # unbalanced quotes: not a usable command
        wanted = []
    for command in (wanted, ["cc"], ["gcc"], ["clang"]):
        if command and shutil.which(command[0]):
            return command
    return None


def _unusable(path: Path) -> str | None:
    """Why compiled libraries cannot be kept in ``path`` (created, mode 0700, if missing), or None if they can:
    another user could change it (:func:`vitkit.hub.cache.untrusted`: what is loaded from it runs in this
    process, and the library names are predictable), it cannot be written, or its mount forbids executing
    code (``noexec``: ``dlopen`` would fail on every library there)."""
    try:
        private_dirs(path)
    except OSError as e:
        return f"cannot be created: {e.strerror or e}"
    why = untrusted(path)
    if why is not None:
        return why
    if not os.access(path, os.W_OK | os.X_OK):
        return "cannot be written"
    if hasattr(os, "statvfs") and os.statvfs(path).f_flag & getattr(os, "ST_NOEXEC", 0):
        return "on a noexec mount, where libraries cannot be loaded"
    with _reported_lock:
        if path in _unloadable:
            return "a library compiled there did not load"
    return None


def private_temp_dir() -> Path | None:
    """The fallback folder: ``vitkit-native-<uid>`` in the system temporary directory (None without uids)."""
    return Path(tempfile.gettempdir()) / f"vitkit-native-{os.getuid()}" if hasattr(os, "getuid") else None


def library_dir() -> Path | None:
    """Where compiled libraries are kept: ``<cache>/native`` (created if missing), else -- when it is not a
    folder only this user (or root) can change, cannot be written or is on a noexec mount -- the private
    per-user temporary folder (:func:`private_temp_dir`), saying so once per process on the ``vitkit.native``
    logger. None when neither can be used (then native kernels are off)."""
    wanted = cache_dir() / "native"
    why = _unusable(wanted)
    if why is None:
        return wanted
    fallback = private_temp_dir()
    why_not = _unusable(fallback) if fallback is not None else "no per-user temporary folder on this system"
    found = fallback if why_not is None else None
    instead = f"using {fallback} instead" if found else f"going on without native kernels ({fallback}: {why_not})"
    _warn_once(f"dir:{wanted}", "vitkit.native: not keeping compiled kernels in %s (%s); %s", wanted, why, instead)
    return found


def build(source: str, name: str, flags: Sequence[str] = ()) -> Path | None:
    """Compile ``source`` into a shared library (``-O2 -shared -fPIC`` plus ``flags``) unless a library of
    the same source, compiler and flags is cached already; its path, or None if that is not possible."""
    where = library_dir()
    return None if where is None else _build(source, name, flags, where)[0]


def _build(source: str, name: str, flags: Sequence[str], where: Path) -> tuple[Path | None, bool]:
    """:func:`build` into ``where``: the library (None when it cannot be built) and whether it was compiled
    now (False: it was cached)."""
    cc = compiler()
    if cc is None:
        return None, False
    args = ["-O2", "-shared", "-fPIC", *flags]
    tag = hashlib.sha256("\0".join([source, *cc, *args]).encode()).hexdigest()[:16]
    lib = where / f"{name}-{tag}.so"
    if lib.is_file():
        return lib, False
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=where) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        write_text_atomic(src, source)
        command = [*cc, *args, str(src), "-o", str(out)]
        try:
            returncode, stderr = _run(command, COMPILE_TIMEOUT_S)
        except OSError as e:  # not executable after all, out of processes
            _report(lib.stem, command, f"could not be started: {e.strerror or e}", b"")
            return None, False
        if returncode is None:  # a compiler that hangs must not hang vitkit
            _report(lib.stem, command, f"gave up after {COMPILE_TIMEOUT_S:g} s", stderr)
            return None, False
        if returncode != 0 or not out.is_file():
            why = f"exit status {returncode}" if returncode != 0 else "exit status 0 but no library written"
            _report(lib.stem, command, why, stderr)
            return None, False
        try:  # copied into place by the one write-then-rename: others see nothing or the whole file
            write_file_atomic(lib, lambda tmp: shutil.copyfile(out, tmp))
        except VitkitError as e:  # a link or a FIFO where the library goes: not followed, not used
            _report(lib.stem, command, str(e), b"")
            return None, False
    return lib, True


def _run(command: list[str], timeout: float) -> tuple[int | None, bytes]:
    """Run ``command`` in a new session: its exit status (None when it ran past ``timeout`` seconds) and its
    stderr. On a timeout, or an exception here (Ctrl-C: a process in its own session does not get the
    terminal's SIGINT), the whole process group is killed, the compiler's children with it."""
    with subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _kill_group(proc)
            return None, e.stderr or b""
        except BaseException:
            _kill_group(proc)
            raise
    return proc.returncode, stderr


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the process group ``proc`` leads (its pid is the group id: ``start_new_session``), then
    reap ``proc``. Its pipes are not read to their end: a process that left the group may hold them open."""
    with contextlib.suppress(OSError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()  # no-op if it was killed above; the leader itself, should the group call have been refused
    proc.wait()


def _report(key: str, command: Sequence[str], why: str, stderr: bytes) -> None:
    """A warning on the ``vitkit.native`` logger, once per ``key`` (library name and content hash) and
    process: the command, why it failed and the first lines of the compiler's errors."""
    if not _first(key):
        return
    lines = stderr.decode(errors="replace").strip().splitlines()
    shown = lines[:STDERR_LINES]
    if len(lines) > STDERR_LINES:
        shown.append(f"... ({len(lines) - STDERR_LINES} more lines)")
    logger.warning(
        "vitkit.native: compiling %s failed (%s); going on without this native kernel. Command: %s%s",
        key,
        why,
        shlex.join(command),
        "".join(f"\n  {line}" for line in shown),
    )


def _first(key: str) -> bool:
    """Whether ``key`` is reported for the first time in this process (and mark it reported)."""
    with _reported_lock:
        if key in _reported:
            return False
        _reported.add(key)
        return True


def _warn_once(key: str, message: str, *args: object) -> None:
    """A warning on the ``vitkit.native`` logger, the first time ``key`` comes up in this process."""
    if _first(key):
        logger.warning(message, *args)


SHARED_HEADER = Path(__file__).with_name("simd.h")  # AVX-512 helpers several kernels share


def kernel_source(path: Path) -> str:
    """The source of the C kernel at ``path`` with ``simd.h`` (the helpers shared by vitkit's AVX-512 kernels)
    in front of it: one text, so that the cache key covers both. A ``#line`` directive keeps the compiler's
    messages on the kernel's own line numbers."""
    return f'{SHARED_HEADER.read_text()}\n#line 1 "{path.name}"\n{path.read_text()}'


def load(source: str, name: str, flags: Sequence[str] = (), needs: Iterable[str] = ()) -> ctypes.CDLL | None:
    """The compiled ``source`` loaded with ctypes, or None when the CPU lacks one of the ``needs`` flags
    (names as in /proc/cpuinfo, e.g. ``avx512_bf16``), there is no compiler, or compilation fails.

    A library that was built but does not load from the cache folder (a mount with ``noexec`` that the
    mount flags do not show, a security policy) is reported once, the folder is not used again in this
    process, and the library is built in the private temporary folder instead."""
    if sys.platform == "win32" or not set(needs) <= hardware.cpu_flags() or compiler() is None:
        return None
    where = library_dir()
    if where is None:
        return None
    loaded, error = _load_from(source, name, flags, where)
    if error is None:
        return loaded
    with _reported_lock:
        _unloadable.add(where)
    fallback = private_temp_dir()
    usable = fallback is not None and fallback != where and _unusable(fallback) is None
    _warn_once(
        f"dir:{where}",  # the key of library_dir's warning: one warning per folder
        "vitkit.native: a kernel compiled in %s does not load (%s); %s",
        where,
        error,
        f"using {fallback} instead" if usable else "going on without native kernels",
    )
    if not usable or fallback is None:
        return None
    loaded, error = _load_from(source, name, flags, fallback)
    if error is not None:
        _warn_once(
            f"load:{fallback}", "vitkit.native: a kernel compiled in %s does not load either (%s)", fallback, error
        )
    return loaded


def _load_from(source: str, name: str, flags: Sequence[str], where: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built in ``where`` and loaded, and None; or None and why a library built there does not
    load; (None, None) when it cannot be built (that is reported by :func:`_build`). A cached library that does
    not load (truncated, damaged: vitkit's own file in its own folder) is removed and built once more."""
    error = "it did not load"
    for _ in range(2):
        lib, fresh = _build(source, name, flags, where)
        if lib is None:
            return None, None
        try:
            return ctypes.CDLL(str(lib)), None
        except OSError as e:
            if fresh:  # a library compiled just now: the folder, not the file, is at fault
                return None, str(e)
            lib.unlink(missing_ok=True)
            error = str(e)
    return None, error
