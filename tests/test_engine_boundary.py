"""The inference engine is the boundary: callers take one thing (an engine spec, made in one helper) and use the
engine's interface (logits, features at a named layer and pooling, attentions), never what runs inside it."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).parents[1] / "src" / "vitkit"
ENGINE = PKG / "inference" / "engine.py"


def _sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted(PKG.rglob("*.py"))}


def test_one_place_turns_a_model_or_an_engine_into_what_a_job_runs() -> None:
    hits = [
        f"{p.relative_to(PKG)}:{text[: m.start()].count(chr(10)) + 1}"
        for p, text in _sources().items()
        for m in re.finditer(r"isinstance\([a-z_.]*, InferenceEngine\)", text)
    ]
    assert len(hits) <= 1, hits  # inference/jobs.py's engine_spec


def test_nothing_outside_the_engine_reaches_into_its_runner() -> None:
    reach = re.compile(r"\.runner\b|forward_blocks")
    hits = [
        f"{p.relative_to(PKG)}:{n}: {line.strip()}"
        for p, text in _sources().items()
        if p not in (ENGINE, PKG / "inference" / "fast.py")  # fast.py defines forward_blocks
        for n, line in enumerate(text.splitlines(), 1)
        if reach.search(line)
    ]
    assert not hits, hits
