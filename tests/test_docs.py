"""The documentation's own rules, checked without building the site (CI also builds it with warnings as errors):
nothing loaded from the network, every public name documented, README and BENCHMARKS.md short and linked, every
benchmark script feeding a table of the report."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from offline_check import external_loads, html_loads  # noqa: E402

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_offline_check_finds_what_a_page_would_load() -> None:
    page = """<!doctype html><html><head>
    <link rel="stylesheet" href="https://fonts.googleapis.com/css2?family=Roboto">
    <link rel="preconnect" href="https://fonts.gstatic.com">
    <link rel="canonical" href="https://example.org/docs/">
    <link rel="stylesheet" href="_static/theme.css">
    <script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>
    <script src="_static/doctools.js"></script>
    <script>var s = document.createElement('script'); s.src = "//unpkg.com/require.js"; // https://in.a/comment
    </script>
    <style>@import url("https://fonts.googleapis.com/css?family=Lato"); body { color: red }</style>
    </head><body>
    <img src="https://img.shields.io/badge.svg"><img srcset="a.png 1x, https://cdn.example/b.png 2x">
    <img src="figures/local.png"><div style="background: url(http://example.com/bg.png)"></div>
    <a href="https://github.com/google-research/vision_transformer">a link is followed only on a click</a>
    <svg xmlns="http://www.w3.org/2000/svg"></svg>
    </body></html>"""
    assert html_loads(page) == [
        "https://fonts.googleapis.com/css2?family=Roboto",
        "https://fonts.gstatic.com",
        "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js",
        "//unpkg.com/require.js",
        "https://fonts.googleapis.com/css?family=Lato",
        "https://img.shields.io/badge.svg",
        "https://cdn.example/b.png",
        "http://example.com/bg.png",
    ]


def test_offline_check_walks_a_site(tmp_path: Path) -> None:
    (tmp_path / "_static").mkdir()
    (tmp_path / "index.html").write_text('<a href="https://example.org">x</a><script src="_static/a.js"></script>')
    (tmp_path / "_static" / "a.js").write_text('/* https://licence.example */ fetch("https://api.example/v1");')
    (tmp_path / "_static" / "a.css").write_text("@font-face { src: url(https://fonts.example/f.woff2) }")
    (tmp_path / "_static" / "ok.css").write_text('.x { background: url("data:image/png;base64,AAAA") }')
    assert external_loads(tmp_path) == [
        ("_static/a.css", "https://fonts.example/f.woff2"),
        ("_static/a.js", "https://api.example/v1"),
    ]


def test_every_public_name_has_a_docstring_and_a_place_in_the_reference() -> None:
    pytest.importorskip("sphinx")
    import vitkit_docs

    import vitkit

    entries = vitkit_docs.all_package_entries()
    undocumented = [e.fullname for e in entries if not vitkit_docs.docstring_of(e)]
    assert not undocumented, f"public names without a docstring (the docs build fails on them): {undocumented}"
    # every package of vitkit has its page; every name of vitkit.__all__ is documented on one
    pages = vitkit_docs.api_pages()
    assert {"vitkit.models", "vitkit.checkpoints", "vitkit.train", "vitkit.inference", "vitkit.serve"} <= set(pages)
    canonical = vitkit_docs.canonical_names()
    documented_here = {f"vitkit.{n}" for n in vitkit.__all__} - set(canonical) - {"vitkit.__version__"}
    assert {"vitkit.load_pretrained", "vitkit.train", "vitkit.VisionTransformer"} <= set(canonical)
    for name in documented_here:  # shown on the reference's first page, from their own docstrings
        obj = getattr(vitkit, name.removeprefix("vitkit."))
        assert (obj.__doc__ or "").strip(), name


@pytest.mark.parametrize(("name", "limit"), [("README.md", 200), ("BENCHMARKS.md", 400)])
def test_front_page_and_report_stay_short(name: str, limit: int) -> None:
    lines = (ROOT / name).read_text().splitlines()
    assert len(lines) <= limit, f"{name} has {len(lines)} lines (at most {limit}): move detail to a page of docs/"


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md", "docs/getting-started.md", "docs/architecture.md"])
def test_relative_links_point_at_files_that_exist(name: str) -> None:
    page = ROOT / name
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (page.parent / path).exists(), f"{name} links to {target}, which does not exist"


def test_every_table_of_the_report_has_its_section_command_and_scripts() -> None:
    import run_all

    report = (ROOT / "BENCHMARKS.md").read_text()
    for table in run_all.TABLES:
        assert f"python benchmarks/run_all.py {table.name}" in report, (
            f"BENCHMARKS.md names no command for {table.name}"
        )
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"run_all.py"}
    used = {Path(a).name for t in run_all.TABLES for argv in t.full + t.quick for a in argv if a.endswith(".py")}
    assert scripts == used, (
        f"scripts that feed no table: {scripts - used}; tables without their script: {used - scripts}"
    )
    for script in scripts:
        doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / script).read_text())) or ""
        assert doc.startswith("Feeds the table"), f"benchmarks/{script}: its docstring must say which table it feeds"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from vitkit.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _command_table() -> list[str]:
    """The first cells of getting-started.md's table under "## Commands" (``vitkit predict -c CKPT ...``)."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(vitkit [^`]+)` \|", section, flags=re.M)


def test_getting_started_names_every_command_of_the_cli() -> None:
    """The command table of getting-started.md against the CLI's own subcommands, both ways: a new command is
    listed there, and a row names no command the CLI lacks."""
    listed = {cell.split()[1] for cell in _command_table()}
    commands = set(_subcommands())
    assert listed == commands, f"missing: {sorted(commands - listed)}, not commands: {sorted(listed - commands)}"


def test_getting_started_names_every_finetune_method() -> None:
    """The table's ``finetune ... --method {a,b}`` row lists exactly the methods the parser accepts."""
    rows = [cell for cell in _command_table() if cell.startswith("vitkit finetune") and "--method" in cell]
    assert len(rows) == 1, rows
    choices = re.search(r"--method \{([^}]*)\}", rows[0])
    assert choices, rows[0]
    listed = set(choices.group(1).split(","))
    method = next(a for a in _subcommands()["finetune"]._actions if "--method" in a.option_strings)
    assert listed == set(method.choices or ()), f"the table: {sorted(listed)}, the CLI: {method.choices}"


def test_readme_links_every_page_of_the_site() -> None:
    """README's documentation table links every page of docs/index.md's toctrees (a page that only includes
    another file, as performance.md includes BENCHMARKS.md, counts as that file)."""
    index = (ROOT / "docs" / "index.md").read_text()
    blocks = re.findall(r"```\{toctree\}\n(.*?)```", index, flags=re.S)
    pages = [line for block in blocks for line in block.splitlines() if line and not line.startswith(":")]
    table = (ROOT / "README.md").read_text().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = {(ROOT / target.split("#", 1)[0]).resolve() for target in LINK.findall(table)}
    for page in pages:
        path = next(p for p in (ROOT / "docs").glob(f"{page}.*") if p.suffix in (".md", ".rst"))
        include = re.match(r"```\{include\} (\S+)", path.read_text())
        target = (path.parent / include.group(1)).resolve() if include else path.resolve()
        assert target in linked, f"README's documentation table has no line for docs/{page} ({target.name})"


def test_training_md_says_finetunes_default_resolution_as_the_tool_chooses_it() -> None:
    """Issue 48: training.md said fine-tuning defaults to a scaled resolution (28 px for the 16 px digits model);
    the tool keeps the checkpoint's own unless --recipe paper-finetune (tests/train/test_run_defaults.py)."""
    text = " ".join((Path(__file__).parents[1] / "docs" / "training.md").read_text().split())
    assert "default: the checkpoint's own scaled as" not in text
    assert "(default: the checkpoint's own, with the schedule `vitkit finetune` sizes from the data;" in text
