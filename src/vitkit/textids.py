"""Names as text: the one text form of an id in every output (:func:`text_id`) and of a name on a terminal
(:func:`printable`)."""

from __future__ import annotations

import re

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
