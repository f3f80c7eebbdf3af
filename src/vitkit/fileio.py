"""Crash-safe file replacement shared by every writer of checkpoints and model folders."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vitkit.errors import CheckpointError


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst`` by renames only. An existing ``dst`` is first renamed aside
    and removed after the new one is in place, so at every instant one complete version exists on disk."""
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
