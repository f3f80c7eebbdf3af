"""Sphinx configuration of vitkit's documentation site.

Build (after ``pip install -e '.[docs]'``), warnings as errors::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST), readable on GitHub as they are; the tutorial is a MyST notebook executed at
every build (myst-nb); the CLI reference is generated from ``vitkit.cli.build_parser`` (sphinx-argparse) and
the API reference from the package's ``__all__`` lists (``_ext/vitkit_docs.py``), so neither can drift. The
same extension fails the build when a public name has no docstring or when a built page would load anything
from the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, SRC)  # the checkout's sources, also without an installed package
# the tutorial's kernel (and the server it starts) run the same sources as the reference documents
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)

from vitkit.version import __version__  # noqa: E402

project = "vitkit"
author = "vitkit contributors"
copyright = "vitkit contributors, Apache-2.0"
version = release = __version__

extensions = [
    "myst_nb",  # Markdown pages (it brings myst_parser) and the executed tutorial
    "sphinx.ext.autodoc",
    "sphinxarg.ext",
    "vitkit_docs",
]

source_suffix = {".md": "myst-nb", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "figures/*.json"]
suppress_warnings: list[str] = []

# every cross-reference must resolve (missing references are warnings, hence errors with -W); the names of other
# packages in type hints cannot resolve offline (no intersphinx inventories are fetched), so they are let through
nitpicky = True
nitpick_ignore_regex = [
    (
        "py:.*",
        r"(torch|numpy|np|PIL|argparse|collections|typing|typing_extensions|os|pathlib|concurrent|threading"
        r"|datetime|enum|io|json|logging|types|tqdm|matplotlib|scipy|onnxruntime|openvino|fastapi|starlette|"
        r"huggingface_hub|datasets|abc|dataclasses|contextlib|ctypes|re|subprocess|queue|http)(\..*)?",
    ),
    (
        "py:class",
        r"(Tensor|Module|Path|PathLike|ndarray|Image|Figure|Axes|Callable|Iterator|Iterable|Sequence|"
        r"Mapping|Any|Literal|Self|NDArray|Generator|ArrayLike|DTypeLike|Event|Lock|Thread|ModuleType|Enum)",
    ),
    (
        "py:class",
        r"(int|float|str|bytes|bool|dict|list|tuple|set|frozenset|object|type|None|NoneType|slice|Ellipsis"
        r"|Exception|ValueError|RuntimeError|OSError|KeyError|TypeError|BaseException|property|classmethod|function)",
    ),
    ("py:class", r"[A-Za-z_]+\.[A-Za-z_.]*"),  # dotted names of other packages that type hints abbreviate
    ("py:.*", r"(.*\.)?([A-Z]|_T.*|[A-Z][A-Za-z0-9_]*_co)"),  # type variables
    ("py:class", r".*[\[\]].*"),  # pieces of a subscripted hint (dict[str, int]) that autodoc splits
]

# autodoc: signatures with their type hints; members in source order; the class docstring, then __init__'s
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autoclass_content = "both"
python_use_unqualified_type_names = True

# MyST
myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 3
smartquotes_action = "qe"  # quotes and ellipses; "--help" keeps its two hyphens

# the tutorial runs at every build, top to bottom, on the CPU; a failing cell fails the build
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
nb_ipywidgets_js: dict[str, dict[str, str]] = {}  # no widget scripts from a CDN

# HTML: a theme whose assets ship with the package; nothing is loaded from other hosts at view time
html_theme = "pydata_sphinx_theme"
html_title = f"vitkit {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"*": [], "api/*": ["sidebar-nav-bs"]}  # the section list where there is a section
html_show_sourcelink = False
html_copy_source = False
# MathJax is not shipped (its default comes from a CDN): the pages use no math, and vitkit_docs fails a page with any
mathjax_path = "_static/no-mathjax.js"
