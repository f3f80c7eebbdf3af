"""Glob patterns of image files (``'photos/**/*.jpg'``), expanded with every folder visited once.

Python's ``glob.glob(recursive=True)`` follows symbolic links to folders in a ``**`` without remembering
where it has been: a link to ``.`` inside the tree lists every file again under ``link/``, ``link/link/`` ...
until the path is too long (one link: each image 41 times; two: past 120 s). Here a ``**`` pattern is matched
while walking the tree from its literal prefix, following links to folders (as glob does) but entering each
folder (by device and inode) once, so every file comes out once and loops end. Patterns without ``**`` go
to ``glob.glob``: each of their components descends one level, so they cannot loop.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator, Sequence


def expand(pattern: str) -> list[str]:
    """The regular files ``pattern`` matches, sorted, each once (glob's rules: ``*``/``?``/``[...]`` within one
    name, ``**`` any number of folders, names starting with ``.`` only where the pattern's name does)."""
    if "**" not in pattern:
        return sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
    parts = pattern.split("/")
    literal = 0
    while literal < len(parts) - 1 and not glob.has_magic(parts[literal]):
        literal += 1
    root = "/".join(parts[:literal])
    start = root or "."
    if pattern.startswith("/") and not root:
        start = root = "/"
    rest = [p for p in parts[literal:] if p]
    found = [
        os.path.join(root, *rel) if root else os.path.join(*rel)
        for rel in _walk(start)
        if _matches(rest, rel) and os.path.isfile(os.path.join(start, *rel))
    ]
    return sorted(found)


def _walk(top: str) -> Iterator[list[str]]:
    """Paths (as lists of names, relative to ``top``) of everything under ``top``, following links to
    folders but entering each folder once: real sub-folders first, so a folder reached both ways keeps its
    own path, then the links to folders not yet entered."""
    try:
        st = os.stat(top)
    except OSError:
        return
    seen = {(st.st_dev, st.st_ino)}
    stack: list[list[str]] = [[]]
    links: list[tuple[list[str], tuple[int, int]]] = []
    while stack or links:
        if stack:
            rel = stack.pop()
        else:
            rel, key = links.pop(0)
            if key in seen:
                continue
            seen.add(key)
        try:
            with os.scandir(os.path.join(top, *rel)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:  # unreadable, or vanished: as glob, nothing from it
            continue
        for entry in entries:
            path = [*rel, entry.name]
            yield path
            try:
                if not entry.is_dir():
                    continue
                est, link = entry.stat(), entry.is_symlink()
            except OSError:
                continue
            key = (est.st_dev, est.st_ino)
            if link:
                links.append((path, key))  # entered later, if no real path reaches the folder first
            elif key not in seen:
                seen.add(key)
                stack.append(path)


def _matches(pattern: Sequence[str], names: Sequence[str]) -> bool:
    """Whether ``names`` (one path, split) matches ``pattern`` (split the same way) under glob's rules."""
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        for i in range(len(names) + 1):
            if _matches(rest, names[i:]):
                return True
            if i < len(names) and names[i].startswith("."):
                return False  # ** does not enter hidden folders
        return False
    if not names or (names[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(names[0], head) and _matches(rest, names[1:])
