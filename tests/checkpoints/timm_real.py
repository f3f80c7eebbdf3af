"""Import the real ``timm`` without torchvision (which cannot be imported here): timm needs torchvision only
for its data transforms and a few layer types that ViT never builds, so every ``torchvision.*`` module is a
stub while timm is imported, then the stubs are removed again (other packages probe for torchvision)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _AnyType(type):
    """A class whose every attribute is another such class: stands for any torchvision name."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_timm() -> types.ModuleType | None:
    """``timm.models.vision_transformer`` (the real package), or None when timm is not installed."""
    if importlib.util.find_spec("timm") is None:
        return None
    finder = _StubFinder()
    real = importlib.util.find_spec("torchvision") is not None
    if not real:
        sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("timm.models.vision_transformer")
    finally:
        if not real:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
