"""The package layering stays true: every import under src/vitkit points down (or sideways without a cycle).

Layers, bottom to top (docs/architecture.md)::

    errors, fileio, hardware, timing, images  <-  models  <-  checkpoints (hub, native)  <-  data  <-  configs, outputs
        <-  train / evaluate / analysis / inference  <-  bench / serve  <-  vitkit (the API)  <-  commands / cli

Imports are read with ``ast`` from the source (module level and inside functions alike), so a lazy import
cannot hide an upward dependency. A package that is not in ``LAYERS`` fails the test: a new package must be
placed in the drawing first.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"
PKG = SRC / "vitkit"

# first name under vitkit -> layer (higher may import lower; equal only without a cycle)
LAYERS: dict[str, int] = {
    "errors": 0,
    "fileio": 0,
    "output_paths": 0,  # may an output go there (every command checks before any work)
    "textids": 0,  # ids and names as text
    "hardware": 0,
    "timing": 0,
    "distributed": 0,  # torchrun process groups (train and the batch jobs)
    "version": 0,
    "lazy": 0,  # names imported on first use (the package faces' __getattr__)
    "images": 0,  # image files and bytes -> decoded pixels, every bound checked first (datasets, checkpoints, serve)
    "models": 1,
    "checkpoints": 2,
    "hub": 2,
    "native": 2,  # run-time C kernels, cached in hub's cache directory
    "data": 3,
    "configs": 4,
    "outputs": 4,  # the chunk store and its assemblers: under inference and train, which both write through it
    "train": 5,
    "evaluate": 5,
    "analysis": 5,
    "inference": 5,
    "bench": 6,
    "search": 5,  # similarity search over embeddings (reads outputs, runs the embed job)
    "serve": 6,
    "ray": 6,  # batch jobs on a Ray cluster: the inference jobs' steps as Ray tasks and actors (vitkit[ray])
    "": 7,  # the package itself: vitkit/__init__.py, the public API
    "commands": 8,
    "cli": 8,
    "__main__": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The vitkit modules ``name`` imports (``from pkg import mod`` resolves to the module ``pkg.mod``)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m == "vitkit" or m.startswith("vitkit.")}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_package_has_a_layer() -> None:
    unplaced = sorted({package_of(m) for m in MODULES} - set(LAYERS))
    assert not unplaced, f"packages missing from LAYERS (place them in the drawing): {unplaced}"


def test_no_upward_import() -> None:
    upward = [
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items()
        for dep in deps
        if LAYERS.get(package_of(dep), 99) > LAYERS.get(package_of(mod), -1)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = defaultdict(set)
    for mod, deps in GRAPH.items():
        packages[package_of(mod)].update(package_of(d) for d in deps if package_of(d) != package_of(mod))
    assert _cycles(packages) == []


def test_no_cycle_between_modules() -> None:
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _cycles(graph) == expected


def test_outputs_sit_under_inference_and_train() -> None:
    """The one output store is below both of its users, and imports nothing above the floor (issue 33)."""
    users = {package_of(m) for m, deps in GRAPH.items() for d in deps if package_of(d) == "outputs"} - {"outputs"}
    assert {"inference", "train"} <= users
    deps = {package_of(d) for m, ds in GRAPH.items() if package_of(m) == "outputs" for d in ds} - {"outputs"}
    assert all(LAYERS[d] == 0 for d in deps), deps


def test_the_reader_sees_lazy_and_package_imports() -> None:
    """The import reader resolves ``from pkg import module`` and finds imports inside functions."""
    assert "vitkit.checkpoints.vitkit_format" in GRAPH["vitkit.checkpoints"]
    lazy = {dep for mod, deps in GRAPH.items() if mod.startswith("vitkit.data.datasets") for dep in deps}
    assert "vitkit.data.folder" in lazy  # imported inside open_dataset
