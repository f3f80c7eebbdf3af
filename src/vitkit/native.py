"""Small C kernels compiled at run time by the system C compiler and loaded through ctypes.

Used by :mod:`vitkit.bench.peak` (the FMA-loop peak) and :mod:`vitkit.inference.fast` (the fused attention
kernel). A source is compiled once per content (source text, compiler and flags hash to the file name) into
``<cache>/native/`` -- the cache directory of :func:`vitkit.hub.cache.cache_dir` (``$VITKIT_HOME``, else
``$XDG_CACHE_HOME/vitkit``, else the platform's user cache) -- or, when that cannot be written, a per-user
directory under the system temporary directory
(only one this user owns and no one else can write). Concurrent processes are safe: each compiles into a private
temporary name in the same directory and renames it into place atomically, so a library is either absent
or complete (two processes compiling at once both produce the same file; the last rename wins).

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
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from vitkit import hardware
from vitkit.hub.cache import cache_dir

COMPILE_TIMEOUT_S = 120.0  # a kernel compiles in about a second; past this the pure-PyTorch path is taken
STDERR_LINES = 12  # of a failed compilation's errors, in the report; the first errors are the telling ones

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # libraries whose failed build was reported in this process (once per source)
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


def _writable_dir(path: Path, private: bool = False) -> Path | None:
    """``path`` created if missing and writable, else None. ``private``: in a shared directory (the system
    temporary one) it must also be a real directory of this user that no one else can write, since what is
    loaded from it runs in this process -- another user could have made it first and planted a library."""
    try:
        path.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return None
    if private and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022):
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def library_dir() -> Path | None:
    """Where compiled libraries are kept (created if missing); None when no candidate is writable."""
    found = _writable_dir(cache_dir() / "native")
    if found is None and hasattr(os, "getuid"):
        found = _writable_dir(Path(tempfile.gettempdir()) / f"vitkit-native-{os.getuid()}", private=True)
    return found


def build(source: str, name: str, flags: Sequence[str] = ()) -> Path | None:
    """Compile ``source`` into a shared library (``-O2 -shared -fPIC`` plus ``flags``) unless a library of
    the same source, compiler and flags is cached already; its path, or None if that is not possible."""
    cc = compiler()
    where = library_dir()
    if cc is None or where is None:
        return None
    args = ["-O2", "-shared", "-fPIC", *flags]
    tag = hashlib.sha256("\0".join([source, *cc, *args]).encode()).hexdigest()[:16]
    lib = where / f"{name}-{tag}.so"
    if lib.is_file():
        return lib
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=where) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        command = [*cc, *args, str(src), "-o", str(out)]
        try:
            returncode, stderr = _run(command, COMPILE_TIMEOUT_S)
        except OSError as e:  # not executable after all, out of processes
            _report(lib.stem, command, f"could not be started: {e.strerror or e}", b"")
            return None
        if returncode is None:  # a compiler that hangs must not hang vitkit
            _report(lib.stem, command, f"gave up after {COMPILE_TIMEOUT_S:g} s", stderr)
            return None
        if returncode != 0 or not out.is_file():
            why = f"exit status {returncode}" if returncode != 0 else "exit status 0 but no library written"
            _report(lib.stem, command, why, stderr)
            return None
        os.replace(out, lib)  # atomic within one directory: other processes see nothing or the whole file
    return lib


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
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
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


SHARED_HEADER = Path(__file__).with_name("simd.h")  # AVX-512 helpers several kernels share


def kernel_source(path: Path) -> str:
    """The source of the C kernel at ``path`` with ``simd.h`` (the helpers shared by vitkit's AVX-512 kernels)
    in front of it: one text, so that the cache key covers both. A ``#line`` directive keeps the compiler's
    messages on the kernel's own line numbers."""
    return f'{SHARED_HEADER.read_text()}\n#line 1 "{path.name}"\n{path.read_text()}'


def load(source: str, name: str, flags: Sequence[str] = (), needs: Iterable[str] = ()) -> ctypes.CDLL | None:
    """The compiled ``source`` loaded with ctypes, or None when the CPU lacks one of the ``needs`` flags
    (names as in /proc/cpuinfo, e.g. ``avx512_bf16``), there is no compiler, or compilation fails."""
    if sys.platform == "win32" or not set(needs) <= hardware.cpu_flags():
        return None
    for attempt in range(2):
        lib = build(source, name, flags)
        if lib is None:
            return None
        try:
            return ctypes.CDLL(str(lib))
        except OSError:  # a cached library that does not load (truncated, damaged): vitkit's own file in its
            if attempt == 0:  # own folder, so it is removed and built once more
                lib.unlink(missing_ok=True)
    return None
