"""The public checkpoints of the modern ViT families (DINOv2, DINOv3, EVA-02, SigLIP, CLIP, DeiT), shipped as data
(resources/vit_families.json, written by tools/build_families.py).

Each entry is a Hugging Face Hub repository -- a transformers folder (``facebook/dinov2-small``) or a timm one
(``timm/vit_small_patch14_reg4_dinov2.lvd142m``) -- known by its Hub id, its timm name without the ``timm/``
owner, and short aliases (``dinov2-small``). Resolving one fetches the repository through huggingface_hub (its
cache, revisions, offline mode), exactly as a Hub id given directly is. Lookup is exact (case-insensitive, an
optional ``@revision``): these names are too alike for prefixes. An entry vitkit cannot load carries the reason
(``refused``) and is listed, never fetched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

FAMILIES = ("dinov2", "dinov3", "eva02", "siglip", "clip", "deit")


@dataclass(frozen=True)
class FamilyEntry:
    """One public checkpoint of a modern family: where it is, what it is, how it loads."""

    name: str  # the Hub id
    aliases: tuple[str, ...]  # timm name (no owner), short names
    family: str  # one of FAMILIES
    architecture: str  # e.g. "S/14+reg4": width letter / patch, registers
    repo_id: str
    format: str  # the vitkit format the folder loads through: "hf" or "timm"
    config: dict[str, Any]  # the checkpoint's own config (config.json's fields; timm: architecture + model_args)
    vitkit_config: dict[str, Any]  # the ViTConfig fields vitkit builds for it (checked against the loader)
    load_options: dict[str, Any]  # what the folder cannot tell the loader (timm's act_layer, eps set in code)
    embedding: str  # the default embedding: "class token", "MAP output", "projected embedding", "logits"
    resolution: int  # the input size of its preprocessing
    preprocess: dict[str, Any]  # as its image processor / timm data config applies it (null: read from it)
    params: int  # computed by vitkit: its model as loaded from this checkpoint (heads and projection included)
    refused: str | None  # why vitkit cannot load it, None when it can
    size_mib: int | None
    sha256: str | None
    source: str
    notes: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FamilyEntry:
        """An entry from its JSON object."""
        return cls(**{**d, "aliases": tuple(d.get("aliases", ()))})

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the entry answers to: its Hub id, then its aliases."""
        return (self.name, *self.aliases)


@cache
def entries() -> tuple[FamilyEntry, ...]:
    """Every family entry, in the shipped order."""
    text = resources.files("vitkit").joinpath("resources", "vit_families.json").read_text("utf-8")
    return tuple(FamilyEntry.from_dict(d) for d in json.loads(text)["models"])


def split_revision(name: str) -> tuple[str, str | None]:
    """``name@rev`` -> (name, rev); (name, None) without one."""
    base, at, rev = name.partition("@")
    return (base, rev) if at and rev else (name, None)


def lookup(name: str) -> FamilyEntry | None:
    """The entry ``name`` (Hub id, timm name or alias; case-insensitive; ``@revision`` aside) designates."""
    key = split_revision(name)[0].lower()
    return next((e for e in entries() if key in (n.lower() for n in e.names)), None)


def search(text: str | None = None, family: str | None = None) -> list[FamilyEntry]:
    """Entries of ``family`` (all without) whose names, architecture or family contain ``text``."""
    t = (text or "").lower()
    return [
        e
        for e in entries()
        if (not family or e.family == family.lower())
        and t in " ".join([*e.names, e.family, e.architecture, e.embedding, e.format]).lower()
    ]
