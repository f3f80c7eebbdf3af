"""The registry of Google's released ViT checkpoints, shipped as data (resources/vit_registry.json).

Names are the paper's (``ViT-B_16-i21k``, ``ViT-B_16-i21k-i1k-384``, ...) and vit_jax's AugReg file stems
(``S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224``).
Lookup is case-insensitive: an exact name or alias wins; otherwise a name that starts exactly one entry's
name picks it, and one that starts several is ambiguous (the error lists the candidates).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from vitkit.errors import CheckpointError


class AmbiguousName(CheckpointError):
    """A short name that matches several registry entries."""


@dataclass(frozen=True)
class Entry:
    """One released checkpoint: where it is and what it is (numbers carry their source)."""

    name: str
    aliases: tuple[str, ...]
    family: str  # "paper" or "augreg"
    architecture: str  # vitkit variant name, e.g. "B/16", "R50+B/16"
    url: str
    format: str
    resolution: int
    num_classes: int
    label_set: str
    pretrain: str
    finetune: str | None
    preprocess: dict[str, Any]
    params_without_head: int
    top1: float | None
    top1_dataset: str | None
    top1_source: str | None
    size_mib: int | None
    sha256: str | None
    source: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        return cls(**{**d, "aliases": tuple(d.get("aliases", ()))})


@cache
def entries() -> tuple[Entry, ...]:
    """Every registry entry, in the shipped order."""
    text = resources.files("vitkit").joinpath("resources", "vit_registry.json").read_text("utf-8")
    return tuple(Entry.from_dict(d) for d in json.loads(text)["models"])


def lookup(name: str) -> Entry | None:
    """The entry ``name`` designates, None when it matches none; AmbiguousName when it matches several."""
    key = name.lower().removesuffix(".npz")
    all_entries = entries()
    exact = [e for e in all_entries if key == e.name.lower() or key in (a.lower() for a in e.aliases)]
    if exact:
        return exact[0]
    prefixed = [e for e in all_entries if e.name.lower().startswith(key)]
    if len(prefixed) == 1:
        return prefixed[0]
    if prefixed:
        more = f", ... ({len(prefixed)} in all)" if len(prefixed) > 8 else ""
        shown = ", ".join(e.name for e in prefixed[:8]) + more
        raise AmbiguousName(f"{name}: ambiguous registry name, matches {shown}; give the full name (vitkit models)")
    return None


def search(text: str | None = None) -> list[Entry]:
    """Entries whose name, architecture, data or source contain ``text`` (case-insensitive); all without."""
    if not text:
        return list(entries())
    t = text.lower()

    def hay(e: Entry) -> str:
        return " ".join(
            [e.name, *e.aliases, e.architecture, e.family, e.pretrain, e.finetune or "", e.label_set, e.url]
        )

    return [e for e in entries() if t in hay(e).lower()]


def close_names(name: str, n: int = 3) -> list[str]:
    """Registry names that look like ``name`` (for 'did you mean' hints)."""
    import difflib

    names = {e.name.lower(): e.name for e in entries()}  # letter case aside: vit-b16 is close to ViT-B_16-i21k
    return [names[c] for c in difflib.get_close_matches(name.lower(), list(names), n=n, cutoff=0.6)]


def markdown_table() -> str:
    """The registry as a Markdown table with numbered sources for the accuracies (docs/pretrained-models.md)."""
    sources: list[str] = []
    lines = [
        "| name | arch | params (no head) | res | pre-training | fine-tuned | ImageNet top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries():
        top1 = "-"
        if e.top1 is not None and e.top1_source:
            if e.top1_source not in sources:
                sources.append(e.top1_source)
            top1 = f"{e.top1:.2f}% [{sources.index(e.top1_source) + 1}]"
        lines.append(
            f"| `{e.name}` | {e.architecture} | {e.params_without_head / 1e6:.1f}M | {e.resolution} | {e.pretrain} | "
            f"{e.finetune or '-'} | {top1} |"
        )
    lines.append("")
    lines += [f"[{i}] {s}" + ("  " if i < len(sources) else "") for i, s in enumerate(sources, 1)]
    return "\n".join(lines) + "\n"
