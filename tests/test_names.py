"""One meaning per name: the public class names and the module basenames of ``src/vitkit`` are unique.

Read from the source itself (``ast``, nothing imported). A repeat fails unless it is allowed below: in
:data:`SAME_CONCEPT`, for a name that really is one concept in two places (each entry says why), or, for now, in
:data:`RENAMED_AT_MERGE`, the repeats that sit in files other work holds open, with the rename each gets. An
entry that no longer matches the tree (the repeat is gone, or has moved) fails too, so the lists stay true."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "vitkit"

# (kind, name) -> (the files that define it, why it is the same concept there)
SAME_CONCEPT: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("module", "predict"): (
        ("commands/predict.py", "inference/predict.py"),
        "`vitkit predict`: the command wires its arguments to the library's predict",
    ),
    ("module", "embed"): (
        ("commands/embed.py", "inference/embed.py"),
        "`vitkit embed`: the command wires its arguments to the library's embed",
    ),
    ("module", "evaluate"): (
        ("commands/evaluate.py", "evaluate/evaluate.py"),
        "`vitkit eval`/`fewshot`/`knn`: the commands wire their arguments to the evaluators",
    ),
    ("module", "demo"): (
        ("commands/demo.py", "serve/demo.py"),
        "`vitkit demo`: the command wires its arguments to the Gradio page",
    ),
    ("module", "families"): (
        ("checkpoints/families.py", "hub/families.py"),
        "the modern families' registry: its entries (hub) and the model each entry loads as (checkpoints)",
    ),
    ("module", "attention"): (
        ("inference/attention.py", "models/attention.py"),
        "softmax(q k^T / sqrt(d)) v, for training (hand-written backward) and for the inference fast path (a fused "
        "kernel); analysis/attention_maps.py is another concept, renamed below",
    ),
}


def defined_names() -> dict[tuple[str, str], list[str]]:
    """(kind, name) -> the files (relative to src/vitkit) defining it: every public class (any nesting) and every
    module's basename (a package's __init__ aside)."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if path.name != "__init__.py":
            found["module", path.stem].append(rel)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found["class", node.name].append(rel)
    return found


def _allowed(key: tuple[str, str]) -> set[str]:
    return {p for table in (SAME_CONCEPT,) for p in table.get(key, ((), ""))[0]}


def test_class_and_module_names_are_unique() -> None:
    found = defined_names()
    assert len(found) > 100, "the source was not found"
    repeats = {
        f"{kind} {name}: {', '.join(where)}"
        for (kind, name), where in found.items()
        if len(where) > 1 and not set(where) <= _allowed((kind, name))
    }
    assert not repeats, "names defined twice (rename one, or allow it with the reason):\n" + "\n".join(sorted(repeats))


def test_every_allowed_repeat_is_still_in_the_tree() -> None:
    found = defined_names()
    for table in (SAME_CONCEPT,):
        for key, (where, why) in table.items():
            assert why, key
            missing = set(where) - set(found.get(key, []))
            assert not missing, f"{key}: allowed in {sorted(missing)}, which no longer define it; drop the entry"
            assert len(found[key]) > 1, f"{key}: no longer repeated; drop the entry"
