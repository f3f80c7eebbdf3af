"""Checkpoint names -> local files.

``resolve(name)`` accepts, in this order:

1. a path that exists locally (always wins, whatever it looks like);
2. an ``http(s)://`` or ``gs://`` URL (public buckets: ``gs://b/p`` is fetched from storage.googleapis.com);
3. a short name from the registry of Google's released checkpoints (``vitkit models``);
4. a name of the families' registry (:mod:`vitkit.hub.families`: ``facebook/dinov2-small``, ``dinov2-small``,
   ``vit_small_patch14_reg4_dinov2.lvd142m``, optionally ``@revision``), fetched as its Hub id is;
5. a Hugging Face Hub id ``org/name`` or ``org/name@revision`` (transformers or timm layout), fetched
   through ``huggingface_hub``: its cache, revisions, offline mode (``HF_HUB_OFFLINE=1``) and token
   (``HF_TOKEN`` / ``hf auth login``).

A name that resolves nowhere is an error listing what was tried.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vitkit.errors import CheckpointError, VitkitError
from vitkit.hub import families, registry
from vitkit.hub.download import DownloadError, download, gs_to_https, is_url
from vitkit.hub.families import FamilyEntry
from vitkit.hub.registry import Entry

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
# a model variant's name (B/16, ViT-L/14, R50+B/16): an architecture, not a checkpoint (vitkit.models.variants)
VARIANT = re.compile(r"(?:ViT-)?(?:R\d*\+)?[A-Za-z]{1,3}/\d{1,3}")


class NotFound(CheckpointError):
    """A checkpoint name that is no local path, URL, registry name or hub id."""


@dataclass(frozen=True)
class Resolved:
    """Where a checkpoint name led."""

    name: str  # as given
    path: Path  # a local file or folder
    kind: str  # "local", "url", "registry" or "hub"
    entry: Entry | None = None  # for registry names
    url: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    family: FamilyEntry | None = None  # for names of the families' registry


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """``org/name[@rev]`` -> (repo id, revision), None when ``name`` is not shaped like a hub id."""
    m = HUB_ID.match(name)
    if not m or looks_like_path(name):
        return None
    return m.group("repo"), m.group("rev")


def resolve(
    name: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Resolved:
    """The local file or folder a checkpoint name designates, downloading it into the cache if needed."""
    text = os.fspath(name)
    if os.path.exists(text):
        return Resolved(text, Path(text), "local")
    if is_url(text):
        return Resolved(text, download(text, cache=cache_dir, progress=progress), "url", url=gs_to_https(text))
    missing = f"{text}: no such file or directory"
    if looks_like_variant(text):
        raise NotFound(
            f"{text}: a model variant (an architecture: vitkit info {text} describes it), not a checkpoint; it has no "
            "weights to load: give a checkpoint file or folder, a run folder, a registry name (vitkit models) or a "
            f"Hugging Face Hub id org/name (vitkit train --model {text} trains one from scratch)"
        )
    if looks_like_path(text) or _in_local_folder(text):
        raise NotFound(f"{missing}{_close_files(text)} (and not a URL, registry name or Hugging Face Hub id)")
    entry = registry.lookup(text)  # raises AmbiguousName with the candidates
    if entry is not None:
        path = download(entry.url, cache=cache_dir, sha256=entry.sha256, progress=progress)
        return Resolved(text, path, "registry", entry=entry, url=gs_to_https(entry.url))
    family = families.lookup(text)
    if family is not None:
        return _fetch_family(text, family)
    close = registry.close_names(text)
    tried = "registry: no such name" + (f" (close: {', '.join(close)})" if close else " (vitkit models lists them)")
    hub = parse_hub_id(text)
    if hub is None:
        raise NotFound(f"{missing}; {tried}; not a URL or an org/name[@revision] Hugging Face Hub id")
    repo_id, revision = hub
    try:
        folder = fetch_hub(repo_id, revision)
    except VitkitError as e:
        raise NotFound(f"{missing}; {tried}; Hugging Face Hub: {e}") from None
    return Resolved(text, folder, "hub", repo_id=repo_id, revision=revision)


def _fetch_family(text: str, entry: FamilyEntry) -> Resolved:
    """A family registry name: its Hub repository (at the name's ``@revision``), unless vitkit refuses it."""
    if entry.refused:
        raise NotFound(f"{text}: {entry.name} is listed but cannot be loaded by vitkit: {entry.refused}")
    revision = families.split_revision(text)[1]
    try:
        folder = fetch_hub(entry.repo_id, revision)
    except VitkitError as e:
        raise NotFound(f"{text}: registry {entry.family} checkpoint {entry.repo_id}, Hugging Face Hub: {e}") from None
    return Resolved(text, folder, "hub", repo_id=entry.repo_id, revision=revision, family=entry)


def looks_like_variant(text: str) -> bool:
    """Spelled as a model variant's name (``B/16``, ``ViT-L/14``, ``R50+B/16``) and no local path."""
    return not os.path.exists(text) and VARIANT.fullmatch(text) is not None


def _in_local_folder(text: str) -> bool:
    """An ``a/b`` name whose folder ``a`` exists here: a local path (mistyped), not a Hub id -- answered at once,
    without asking the network."""
    parent = Path(text).parent
    return parent != Path(".") and parent.is_dir()


def _close_files(text: str) -> str:
    """ " (close: ...)" naming the entries of the path's folder that look like it; "" when none does."""
    import difflib

    path = Path(text)
    folder = path.parent
    try:
        names = [e.name for e in os.scandir(folder if str(folder) else ".")][:10_000]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f" (close: {', '.join(str(folder / c) for c in close)})" if close else ""


def looks_like_path(text: str) -> bool:
    """Spelled as a file path (absolute, relative with ./ or ../, ~, several folders, a weights suffix)."""
    return (
        text.startswith(("/", "./", "../", "~", "\\"))
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or Path(text).suffix.lower() in (".npz", ".safetensors", ".pth", ".pt", ".bin", ".onnx", ".json")
    )


# ---- Hugging Face Hub ----------------------------------------------------------------------------------

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def fetch_hub(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of a hub repository's config and weights (huggingface_hub's cache)."""
    label = f"{repo_id}@{revision}" if revision else repo_id
    config = _hub_file(repo_id, "config.json", revision, label, required=True)
    assert config is not None
    folder = Path(config).parent
    found = (_hub_file(repo_id, fname, revision, label, required=False) for fname in WEIGHT_FILES)
    weights = next((w for w in found if w is not None), None)  # the first the repository has
    if weights is None:
        raise VitkitError(
            f"{label}: none of {', '.join(WEIGHT_FILES)} in the repository (or, offline, in the local cache)"
        )
    if weights.endswith(".index.json"):
        shards = sorted(set(json.loads(Path(weights).read_text()).get("weight_map", {}).values()))
        for shard in shards:
            _hub_file(repo_id, shard, revision, label, required=True)
    _hub_file(repo_id, "preprocessor_config.json", revision, label, required=False)
    return folder


def is_hub_cached(repo_id: str, revision: str | None = None) -> bool:
    """Whether huggingface_hub's cache holds a repository's config.json and weights (no network)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)

    return cached("config.json") and any(cached(f) for f in WEIGHT_FILES)


@contextmanager
def quiet_logs(*names: str) -> Iterator[None]:
    """The loggers ``names`` at level ERROR meanwhile: huggingface_hub (and ``datasets``) log every retry of an
    unreachable host as a warning; the error that follows says it."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _hub_file(repo_id: str, filename: str, revision: str | None, label: str, required: bool) -> str | None:
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import hf_hub_download

    try:
        with quiet_logs("huggingface_hub"):
            return str(hf_hub_download(repo_id=repo_id, filename=filename, revision=revision))
    except hf_errors.LocalEntryNotFoundError:
        if not required:
            return None
        raise VitkitError(
            f"{label}: {filename} is not in the local Hugging Face cache and the Hub cannot be reached (offline "
            f"mode or no network); connect and run vitkit download {label}, or pass a local folder"
        ) from None
    except hf_errors.EntryNotFoundError:
        if required:
            raise VitkitError(f"{label}: the repository has no {filename}") from None
        return None
    except hf_errors.GatedRepoError:
        raise VitkitError(
            f"{label}: gated repository; accept its terms on huggingface.co and log in (hf auth login or HF_TOKEN)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise VitkitError(
            f"{label}: no such repository (or a private one: log in with hf auth login or HF_TOKEN)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise VitkitError(f"{label}: no revision {revision!r} in {repo_id}") from None
    except hf_errors.HfHubHTTPError as e:
        raise VitkitError(f"{label}: Hugging Face Hub error ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise DownloadError(f"{label}: {filename}: {e.strerror or e}") from None
