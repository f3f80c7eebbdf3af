"""May an output go there? The checks every command makes on its output paths before any work (README: "never
delete or overwrite what vitkit did not write"): a file is replaced only with ``overwrite`` and never through a
link (:func:`check_output_file`); a folder only when vitkit wrote it and ``overwrite`` says so
(:func:`check_output_dir`), a report folder only when it holds an earlier report (:func:`check_report_dir`); an
output never overlaps its input (:func:`check_not_input`); and the nearest existing folder must be writable
(:func:`check_output_location`), so that a read-only place fails before the work, not after it. The writing
itself is :mod:`vitkit.fileio`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from vitkit.errors import CheckpointError, ConfigError
from vitkit.fileio import is_regular, open_regular, refuse_link

REPORT_JSON_MAX_BYTES = 64 << 20  # an earlier report's JSON read back to recognise it (21k classes: ~2 MB)


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
    """May ``out`` be (re)written as a file? Missing: yes; an existing file only with ``overwrite``; a link
    (dangling or not), FIFO or device never."""
    refuse_link(out)
    if out.is_dir():
        raise CheckpointError(f"{out}: is a folder; name a file")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists; pass --overwrite (overwrite=True) to replace it")
    check_output_location(out)  # written beside it, then renamed into place


def check_report_dir(out: Path, names: Callable[[str], bool], json_key: tuple[str, str], what: str) -> None:
    """May report files be written into ``out``? A missing or empty folder, or one holding only files of an
    earlier report (``names``; its JSON file ``json_key[0]`` must hold the key ``json_key[1]``)."""
    if out.is_symlink():
        raise ConfigError(f"{out}: is a symbolic link; vitkit never writes through links (name the folder itself)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder; --out names a folder")
    check_output_location(out, inside=True)
    if not out.is_dir():
        return
    for entry in sorted(out.iterdir()):
        if entry.is_symlink():
            raise ConfigError(f"{entry}: is a symbolic link; vitkit never writes through links (remove it)")
        ours = names(entry.name) and is_regular(entry)
        if ours and entry.name == json_key[0]:
            try:
                with open_regular(entry, "", write=False) as f:
                    doc = json.loads(f.read(REPORT_JSON_MAX_BYTES))
            except (ConfigError, ValueError):
                doc = None
            ours = isinstance(doc, dict) and json_key[1] in doc
        if not ours:
            raise ConfigError(
                f"{out}: holds {entry.name!r}, which is not from a {what}; choose an empty or new --out folder "
                "(vitkit never overwrites what it did not write)"
            )
