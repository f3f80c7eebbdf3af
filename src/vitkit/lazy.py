"""A package's names imported on first use (PEP 562): ``import vitkit`` and the command line's parser stay free of
the model code (torch) until a name is used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, table: Mapping[str, str | tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table[name]`` is the module that defines ``name`` (or
    (module, attribute) for a name it defines under another); the value is imported on first use and then kept in
    the package. Any other name: AttributeError."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = (where, name) if isinstance(where, str) else where
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
