"""Sphinx extension of vitkit's docs: the API reference generated from the code, and the build's own checks.

- ``.. vitkit-api:: vitkit.PACKAGE`` documents a package's public names: its ``__all__``, or, for a package
  without one (``bench``, ``data``), the public functions and classes of each of its modules. A name added to
  the code appears in the reference at the next build; one without a docstring is a warning (an error in CI,
  which builds with ``-W``).
- ``.. vitkit-api-index::`` lists ``vitkit.__all__`` with a link and a one-line summary each, documents the
  names no package exports, and makes ``vitkit.NAME`` a reference target of the object it names.
- After the build, every page, stylesheet and script is checked for anything it would load from another host
  (``offline_check.py``); one such reference is a warning, so the site works without a network.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from offline_check import external_loads
from sphinx.application import Sphinx
from sphinx.domains.python import ObjectEntry
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

# the packages of the reference, in the order of the layers (bottom first); a package added to vitkit and not
# named here is documented too, after these (``commands`` is the CLI's wiring, documented as the CLI reference)
LAYER_ORDER = [
    "models",
    "checkpoints",
    "hub",
    "data",
    "configs",
    "outputs",
    "train",
    "evaluate",
    "analysis",
    "inference",
    "bench",
    "serve",
]
NOT_API = {"commands"}
# the top-level modules documented on one page ("the floor": errors, devices, timing, files, images, compiled kernels)
CORE_MODULES = [
    "errors",
    "hardware",
    "timing",
    "fileio",
    "output_paths",
    "textids",
    "images",
    "native",
    "distributed",
    "ray",
]


def packages() -> list[str]:
    import vitkit

    found = [i.name for i in pkgutil.iter_modules(vitkit.__path__) if i.ispkg and i.name not in NOT_API]
    return [p for p in LAYER_ORDER if p in found] + sorted(set(found) - set(LAYER_ORDER))


@dataclass
class Entry:
    """One public name: where it is documented (``vitkit.pkg.name`` or ``vitkit.pkg.module.name``) and what."""

    fullname: str
    obj: Any
    kind: str  # autodoc's: function, class, exception, data, module


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return "data"


def _defined_public(module: Any) -> list[str]:
    """A module's ``__all__``, else its public functions and classes defined in it (not imported)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        n
        for n, o in vars(module).items()
        if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o)) and o.__module__ == module.__name__
    ]


def public_api(package: str) -> list[tuple[str, list[Entry]]]:
    """The public names of ``package``, as (module documented, entries) sections."""
    pkg = importlib.import_module(package)
    if not hasattr(pkg, "__path__"):  # a module
        return [
            (package, [Entry(f"{package}.{n}", getattr(pkg, n), _kind(getattr(pkg, n))) for n in _defined_public(pkg)])
        ]
    if hasattr(pkg, "__all__"):
        return [(package, [Entry(f"{package}.{n}", getattr(pkg, n), _kind(getattr(pkg, n))) for n in pkg.__all__])]
    sections = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        entries = [Entry(f"{mod.__name__}.{n}", getattr(mod, n), _kind(getattr(mod, n))) for n in _defined_public(mod)]
        sections.append((mod.__name__, entries))
    return sections


def api_pages() -> dict[str, list[str]]:
    """Page name -> the packages or modules it documents."""
    pages = {f"vitkit.{p}": [f"vitkit.{p}"] for p in packages()}
    pages["vitkit.core"] = [f"vitkit.{m}" for m in CORE_MODULES]
    return pages


def all_package_entries() -> list[Entry]:
    return [e for names in api_pages().values() for n in names for _, entries in public_api(n) for e in entries]


def _attribute_doc(entry: Entry) -> str:
    """The ``#:`` comment or docstring after an assignment that documents a module-level constant."""
    owner, _, name = entry.fullname.rpartition(".")
    candidates = [owner]
    pkg = importlib.import_module(owner)
    if hasattr(pkg, "__path__"):  # a package re-exporting a submodule's constant: look in its modules
        candidates += [f"{owner}.{i.name}" for i in pkgutil.iter_modules(pkg.__path__)]
    for modname in candidates:
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:
            continue
        if ("", name) in docs:
            return "\n".join(docs[("", name)]).strip()
    return ""


def docstring_of(entry: Entry) -> str:
    """The entry's own documentation; empty when it has none (dataclasses' generated signature counts as none)."""
    if entry.kind == "data":
        return _attribute_doc(entry)
    doc = entry.obj.__doc__ or ""  # a class's own __doc__: not inherited, unlike inspect.getdoc
    if inspect.isclass(entry.obj) and doc.startswith(f"{entry.obj.__name__}("):
        return ""
    return inspect.cleandoc(doc)


def summary_of(entry: Entry) -> str:
    text = docstring_of(entry)
    first = text.split("\n\n")[0].replace("\n", " ").strip()
    return first.split(". ")[0].rstrip(".") + "." if first else ""


def autodoc_lines(entry: Entry) -> list[str]:
    if entry.kind == "data":  # its #: comment may sit in the submodule that defines it, where autodoc does not look
        doc = docstring_of(entry).splitlines() or [""]
        return [f".. py:data:: {entry.fullname}", "", *(f"   {line}" for line in doc), ""]
    lines = [f".. auto{entry.kind}:: {entry.fullname}"]
    if entry.kind in ("class", "exception"):
        lines += ["   :members:", "   :undoc-members:"]
        if entry.obj.__bases__ != (object,):
            lines += ["   :show-inheritance:"]
        if entry.kind == "class":
            lines += ["   :exclude-members: __init__, __new__"]
    return [*lines, ""]


class ApiDirective(SphinxDirective):
    """``.. vitkit-api:: vitkit.PACKAGE``: the package's public names, documented from their docstrings."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        lines: list[str] = [f".. automodule:: {package}", "   :no-members:", ""]
        for module, entries in public_api(package):
            if module != package:
                title = f"``{module.removeprefix(package + '.')}``"
                lines += [title, "-" * len(title), "", f".. automodule:: {module}", "   :no-members:", ""]
            for entry in entries:
                if not docstring_of(entry):
                    logger.warning(
                        "undocumented public name %s: give it a docstring (or a #: comment for a constant)",
                        entry.fullname,
                        location=self.get_location(),
                        type="vitkit",
                        subtype="undocumented",
                    )
                lines += autodoc_lines(entry)
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source=self.get_source_info()[0]), node)
        return list(node.children)


def top_level_names() -> list[tuple[str, Any]]:
    import vitkit

    return [(n, getattr(vitkit, n)) for n in vitkit.__all__]


def canonical_names() -> dict[str, str]:
    """``vitkit.NAME`` -> the full name under which a package page documents the same object."""
    by_id = {}
    for entry in all_package_entries():
        by_id.setdefault(id(entry.obj), entry.fullname)
    return {f"vitkit.{n}": by_id[id(o)] for n, o in top_level_names() if id(o) in by_id and n != "__version__"}


class ApiIndexDirective(SphinxDirective):
    """``.. vitkit-api-index::``: ``vitkit.__all__``, each with a link and a summary; names no package exports are
    documented here."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        canonical = canonical_names()
        rows = [".. list-table::", "   :header-rows: 1", "   :widths: 30 70", "", "   * - name", "     - what it is"]
        local: list[Entry] = []
        for name, obj in top_level_names():
            if name == "__version__":
                rows += ["   * - :py:data:`vitkit.__version__`", "     - The installed version of vitkit."]
                continue
            entry = Entry(f"vitkit.{name}", obj, _kind(obj))
            if entry.fullname not in canonical:
                local.append(entry)
            if not docstring_of(entry):
                logger.warning(
                    "undocumented public name %s",
                    entry.fullname,
                    location=self.get_location(),
                    type="vitkit",
                    subtype="undocumented",
                )
            rows += [f"   * - :py:obj:`vitkit.{name}`", f"     - {summary_of(entry)}"]
        lines = [*rows, ""]
        if local:
            lines += ["Names no package exports", "------------------------", ""]
            for entry in local:
                lines += autodoc_lines(entry)
        lines += [".. py:data:: vitkit.__version__", "   :type: str", "", "   The installed version of vitkit.", ""]
        lines += ["Packages", "--------", "", ".. toctree::", "   :maxdepth: 1", ""]
        lines += [f"   {page}" for page in api_pages()] + [""]
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source=self.get_source_info()[0]), node)
        return list(node.children)


def add_aliases(app: Sphinx, env: Any) -> None:
    """Make ``vitkit.NAME`` resolve to where a package page documents the object (``vitkit.load_pretrained`` ->
    ``vitkit.checkpoints.load_pretrained``)."""
    objects: dict[str, ObjectEntry] = env.domaindata["py"]["objects"]
    for alias, target in canonical_names().items():
        if target in objects and alias not in objects:
            found = objects[target]
            objects[alias] = ObjectEntry(found.docname, found.node_id, found.objtype, True)
        elif target not in objects:
            logger.warning("%s is exported as %s but not documented", target, alias, type="vitkit", subtype="alias")


def _resolve_import(target: str) -> bool:
    """Whether ``target`` (``vitkit.a.b.name``) names an object of vitkit's own (not one it imported, such as
    ``torch.Tensor`` in a module's namespace)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        return home is None or str(home).startswith("vitkit")  # None: a constant, found in vitkit's module
    return False


def resolve_reference(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    """Python references the domain did not find: a name written relative to another module than the one documented
    (``load_checkpoint`` in a docstring of ``vitkit.checkpoints.preprocess``) resolves to the one documented object of
    that name; a real object that is not public (``vitkit.serve.served_model.calibration_batch``) to the page of the
    module or package holding it. A name that exists nowhere stays missing (an error with -W)."""
    if node.get("refdomain") != "py":
        return None
    from sphinx.util.nodes import make_refnode

    objects: dict[str, ObjectEntry] = env.domaindata["py"]["objects"]
    target = node["reftarget"].lstrip("~.")
    module = node.get("py:module") or ""
    package = ".".join(module.split(".")[:2])
    found = [k for k in objects if k.endswith("." + target) and k.startswith("vitkit.") and not objects[k].aliased]
    if len(found) > 1:
        found = [k for k in found if k.startswith(package + ".")] or found
    if len(found) == 1:
        entry = objects[found[0]]
        return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, found[0])
    import sys

    holders = [m for m in sorted(sys.modules) if m.startswith(package + ".") and hasattr(sys.modules[m], target)]
    for full in (target, f"{module}.{target}" if module else target, *(f"{m}.{target}" for m in holders)):
        if full.startswith("vitkit.") and _resolve_import(full):
            parts = full.split(".")
            for i in range(len(parts) - 1, 1, -1):
                holder = ".".join(parts[:i])
                if holder in objects and objects[holder].objtype == "module":
                    entry = objects[holder]
                    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, full)
    return None


def check_offline(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for file, url in external_loads(Path(app.outdir)):
        logger.warning(
            "%s loads %s from the network: the docs must work offline", file, url, type="vitkit", subtype="offline"
        )


def write_package_pages(app: Sphinx) -> None:
    """One page per package under ``api/`` (generated, not committed), so a new package gets its page."""
    folder = Path(app.srcdir) / "api"
    folder.mkdir(exist_ok=True)
    pages = api_pages()
    for old in folder.glob("vitkit.*.rst"):
        if old.stem not in pages:
            old.unlink()
    for name, documented in pages.items():
        title = "Core modules" if name == "vitkit.core" else f"``{name}``"
        page = f"{title}\n{'=' * len(title)}\n\n"
        if name == "vitkit.core":
            page += "The modules every layer builds on: errors, devices and CPU capabilities, timing, safe writes, "
            page += "C kernels.\n\n"
            page += "".join(f"{m}\n{'-' * len(m)}\n\n.. vitkit-api:: {m}\n\n" for m in documented)
        else:
            page += f".. vitkit-api:: {name}\n"
        path = folder / f"{name}.rst"
        if not path.exists() or path.read_text() != page:  # unchanged pages keep their time stamps
            path.write_text(page)


def no_math(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    if context.get("has_maths_elements"):
        logger.warning(
            "page %s has math, which would need MathJax from a CDN: write it as text",
            pagename,
            type="vitkit",
            subtype="offline",
        )


# links between the repository's top-level files, as the site names those pages
SITE_PAGES = {"BENCHMARKS.md": "docs/performance.md", "README.md": "docs/index.md"}


def site_links(app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]) -> None:
    """README.md and BENCHMARKS.md link to each other by their file names on GitHub; in the site they are the
    front page and the Performance page (the include's ``relative-docs`` then makes ``docs/...`` relative)."""
    if Path(relative_path).name not in SITE_PAGES:
        return
    text = content[0]
    for name, page in SITE_PAGES.items():
        text = text.replace(f"]({name}", f"]({page}")
    content[0] = text


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("include-read", site_links)
    app.connect("html-page-context", no_math)
    app.connect("builder-inited", write_package_pages)
    app.add_directive("vitkit-api", ApiDirective)
    app.add_directive("vitkit-api-index", ApiIndexDirective)
    app.connect("env-updated", add_aliases)
    app.connect("missing-reference", resolve_reference)
    app.connect("build-finished", check_offline)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
