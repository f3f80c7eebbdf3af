"""Writes the registry table into docs/pretrained-models.md between its registry-table markers (a test checks it
is current).

Run: PYTHONPATH=src python tools/registry_table.py
"""

from __future__ import annotations

from pathlib import Path

from vitkit.hub.registry import markdown_table

START, END = "<!-- registry-table:start -->", "<!-- registry-table:end -->"


def main() -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "pretrained-models.md"
    text = page.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{markdown_table()}{END}{tail}")
    print(f"updated {page}")


if __name__ == "__main__":
    main()
