"""Writes the registry table into README.md between its registry-table markers (tests check it is current).

Run: PYTHONPATH=src python tools/registry_table.py
"""

from __future__ import annotations

from pathlib import Path

from vitkit.hub.registry import markdown_table

START, END = "<!-- registry-table:start -->", "<!-- registry-table:end -->"


def main() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{markdown_table()}{END}{tail}")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
