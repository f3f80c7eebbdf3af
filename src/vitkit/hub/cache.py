"""Where vitkit keeps what it downloads: one cache directory.

Chosen in this order: an explicit ``cache_dir`` (``--cache-dir``), the ``VITKIT_HOME`` environment variable
(like ``TORCH_HOME`` / ``HF_HOME``), ``$XDG_CACHE_HOME/vitkit``, then the platform's user cache directory
(``~/.cache/vitkit`` on Linux, ``~/Library/Caches/vitkit`` on macOS, ``%LOCALAPPDATA%\\vitkit\\Cache`` on
Windows). Hugging Face Hub repositories stay in huggingface_hub's own cache (``HF_HOME``/``HF_HUB_CACHE``).

What vitkit keeps there is trusted by the processes that use it (compiled kernels are loaded and run, weights
are loaded), so it is used only where no other local user can change it: :func:`untrusted` says why a folder
fails that, and :func:`private_dirs` creates missing folders with mode 0700, as the XDG base directory
specification asks of a cache.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

#: The environment variable that names vitkit's cache folder (downloads, compiled kernels).
ENV_VAR = "VITKIT_HOME"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory (not created here)."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vitkit"
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "vitkit"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return (Path(local) if local else home / "AppData" / "Local") / "vitkit" / "Cache"
    return home / ".cache" / "vitkit"


def private_dirs(folder: Path) -> None:
    """Create ``folder`` and its missing parents with mode 0700 (the XDG base directory rule for a cache; a
    folder others cannot enter cannot be tampered with). Folders that exist keep their mode."""
    missing: list[Path] = []
    for p in (folder, *folder.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # another process made it in between: used only if no one else can change it
            why = untrusted(p)
            if why is not None:
                raise PermissionError(errno.EPERM, f"created meanwhile by another process, and {why}", str(p)) from None


def untrusted(folder: Path, *, sticky_ok: bool = False) -> str | None:
    """Why another local user could change what is in ``folder`` (one phrase naming the path at fault), or
    None when only this user and root can.

    The path is walked as the kernel resolves it, from ``/`` down, following symbolic links and walking
    their targets in turn: every folder on the way must be owned by this user or root, and writable by no
    one else (group or others) unless it has the sticky bit (like ``/tmp``: others may add names but not
    rename or remove ours); ``folder`` itself must be writable by no one else, sticky or not; a symbolic link
    must be owned by this user or root (no one else created it). A folder its group can write counts as
    private when that group is this user's own (user private groups, as Debian, Ubuntu and Fedora make for
    each user and their umask 002 leaves writable: the user's primary group, named as the user, with no other
    members). ``sticky_ok``: ``folder`` may be sticky too,
    as a parent (to check the deepest existing folder before creating private ones in it). Not checked where
    there is no POSIX ownership (Windows)."""
    if not hasattr(os, "getuid"):
        return None
    owners = {os.getuid(), 0}
    path = Path.cwd() / folder  # absolute, ".." kept: it is resolved after the links before it, as the kernel does
    current = Path(path.anchor)
    todo = list(path.parts[1:])
    links = 0
    while True:
        try:
            st = os.lstat(current)
        except OSError as e:
            return f"{current}: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in owners:
                return f"{current} is a symbolic link made by another user (uid {st.st_uid})"
            links += 1
            if links > 40:
                return f"{current}: too many levels of symbolic links"
            target = Path(os.readlink(current))
            todo[:0] = target.parts[1:] if target.is_absolute() else target.parts
            current = Path(target.anchor) if target.is_absolute() else current.parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"{current} is not a folder"
        if st.st_uid not in owners:
            return f"{current} is owned by another user (uid {st.st_uid})"
        others = st.st_mode & (0o002 if _own_group(st.st_gid) else 0o022)
        if others and not (st.st_mode & stat.S_ISVTX and (todo or sticky_ok)):
            who = "others" if st.st_mode & 0o002 else "its group"
            return f"{current} can be written by {who} (mode {stat.S_IMODE(st.st_mode):o})"
        if not todo:
            return None
        name = todo.pop(0)
        current = current.parent if name == ".." else current / name


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group: the primary group, named as the user, no other members."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):  # no such databases (Windows), or ids without names (containers)
        return False
    return gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}
