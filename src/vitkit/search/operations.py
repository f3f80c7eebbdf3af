"""What ``vitkit index``, ``vitkit search`` and ``vitkit dedup`` do, as library functions (the CLI only wires its
arguments to these).

Building from images embeds them first through ``vitkit embed``'s job (:func:`vitkit.inference.embed.embed_job`)
into ``.INDEX.embed.npy`` beside the index (resumable: a killed build continues from its chunks when run again),
then indexes that file and removes it. Adding works the same way; the index itself is replaced only once the new
one is complete (:meth:`vitkit.search.index.Index.save`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import ConfigError, DataError
from vitkit.fileio import clean_stale, write_text_atomic
from vitkit.outputs.array_reader import EMBED_FORMATS, ids_path, read_embeddings
from vitkit.outputs.rows import csv_text
from vitkit.outputs.store import CHECKPOINT, PRECISION, PREPROCESS
from vitkit.search.index import Hit, Index

CHECKPOINT_SOURCE = "vitkit.index.checkpoint"  # the -c an index was built with, used by search when -c is not given


@dataclass
class EmbedSettings:
    """How images are embedded on the way into an index (as ``vitkit embed``'s options)."""

    pool: str | None = None
    layer: int | None = None
    precision: str = "auto"
    batch_size: int = 32
    device: str = "cpu"
    workers: int = 0
    skip_bad: bool = False
    format: str | None = None
    progress: bool = True
    steps: Any = None  # what runs the embedding's steps: None, the local loop; vitkit.ray.steps(...) for --ray


def is_embeddings(source: Sequence[str]) -> bool:
    """Whether ``source`` names one output file of ``vitkit embed`` (by its suffix) rather than images."""
    return len(source) == 1 and Path(source[0]).suffix.lower() in EMBED_FORMATS and Path(source[0]).is_file()


def side_file(index: Path) -> Path:
    """Where the images of a build or add are embedded on the way: ``.INDEX.embed.npy`` beside the index."""
    return index.with_name(f".{index.name}.embed.npy")


def _embed_images(
    checkpoint: str, images: Sequence[str], data: str | None, split: str, index: Path, s: EmbedSettings,
    on_engine: Callable[[Any], None] | None,
) -> Path:  # fmt: skip
    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.stream import open_source
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.outputs.arrays import check_embeddings_output

    side = side_file(index)
    if bool(images) == bool(data):
        raise ConfigError("give image files/folders/patterns or --data DATASET (one of the two)")
    check_embeddings_output(side, resume=True, overwrite=False)
    source = open_source(images, data, split, skip_bad=s.skip_bad)
    loaded = load_checkpoint(checkpoint, format=s.format)
    opts = EmbedOptions(pool=s.pool, layer=s.layer, precision=s.precision, batch_size=s.batch_size, device=s.device,
                        workers=s.workers, skip_bad=s.skip_bad, progress=s.progress)  # fmt: skip
    opts.check(loaded.model.cfg.depth, bool(loaded.model.cfg.class_token))
    if opts.pool == "tokens":
        raise ConfigError("--pool tokens: an index takes one vector per image (cls, gap or the default)")
    embed_job(loaded, source, opts, side, resume=True, on_engine=on_engine, steps=s.steps)
    return side


def _drop_side(side: Path) -> None:
    for p in (side, ids_path(side)):
        p.unlink(missing_ok=True)


def build_index(
    source: Sequence[str], out: str | os.PathLike[str], *, checkpoint: str | None = None, data: str | None = None,
    split: str = "test", backend: str = "exact", overwrite: bool = False, settings: EmbedSettings | None = None,
    notes: list[str] | None = None, on_engine: Callable[[Any], None] | None = None,
) -> Index:  # fmt: skip
    """``vitkit index SOURCE --out INDEX``: an index of an embedding output, or of images / a dataset embedded with
    ``checkpoint`` on the way; written to ``out``."""
    target = Path(out)
    if os.path.lexists(target) and not overwrite:
        raise ConfigError(f"--out {target}: exists; choose a new path (or --overwrite an index there)")
    if checkpoint is None:
        if data or not is_embeddings(source):
            raise ConfigError("SOURCE is not an output of vitkit embed (.parquet, .npy, .safetensors); to index "
                              "images or a dataset give the checkpoint with -c")  # fmt: skip
        index = Index.from_embeddings(source[0], backend=backend, notes=notes)
    else:
        side = _embed_images(checkpoint, source, data, split, target, settings or EmbedSettings(), on_engine)
        index = Index.from_embeddings(side, backend=backend, notes=notes)
        index.provenance[CHECKPOINT_SOURCE] = checkpoint
    index.save(target, overwrite=overwrite)
    if checkpoint is not None:
        _drop_side(side_file(target))
    return index


def add_to_index(
    source: Sequence[str], path: str | os.PathLike[str], *, checkpoint: str | None = None, data: str | None = None,
    split: str = "test", settings: EmbedSettings | None = None, notes: list[str] | None = None,
    on_engine: Callable[[Any], None] | None = None,
) -> tuple[Index, int]:  # fmt: skip
    """``vitkit index --add SOURCE INDEX``: the index with the vectors of ``source`` appended (ids already there
    skipped, so running it again after a kill completes it), and how many were added."""
    target = Path(path)
    clean_stale(target.parent, [target.name])  # what a kill left: the old index set aside, a half-written new one
    index = Index.open(target)
    if checkpoint is None and not data and is_embeddings(source):
        added = index.add_embeddings(source[0], notes=notes)
    else:
        ckpt = checkpoint or index.provenance.get(CHECKPOINT_SOURCE)
        if ckpt is None:
            raise ConfigError("to add images give the index's checkpoint with -c")
        side = _embed_images(ckpt, source, data, split, target, settings or settings_of(index), on_engine)
        added = index.add_embeddings(side, notes=notes)
    if added:
        index.save(target, overwrite=True)
    if checkpoint is not None or not is_embeddings(source):
        _drop_side(side_file(target))
    return index, added


def read_ids_arg(ids: str) -> list[str]:
    """``--remove IDS``: ``id:ID`` for one id, else a text file of ids, one a line."""
    if ids.startswith("id:"):
        return [ids[3:]]
    p = Path(ids)
    if not p.is_file():
        raise DataError(f"--remove {ids}: no such file (give a file of ids, one a line, or id:ID)")
    if p.stat().st_size > 1 << 30:
        raise DataError(f"--remove {ids}: more than 1 GiB; not a list of ids")
    return [line for line in p.read_text(encoding="utf-8").splitlines() if line]


def remove_from_index(ids: Sequence[str], path: str | os.PathLike[str]) -> tuple[Index, int]:
    """``vitkit index --remove IDS INDEX``: the index without ``ids`` (those not there ignored), and how many went."""
    target = Path(path)
    clean_stale(target.parent, [target.name])
    index = Index.open(target)
    removed = index.remove(ids)
    if removed:
        index.save(target, overwrite=True)
    return index, removed


# ---- search ------------------------------------------------------------------------------------------------


def settings_of(index: Index) -> EmbedSettings:
    """How the index's images were embedded, as its provenance records it: the pooling, the layer and the engine
    precision (``fp32`` when the index does not say: one built from another tool's vectors). Image queries and
    additions are embedded with these, so that a query of an indexed image finds it at a score of 1."""
    pool = index.provenance.get("vitkit.embed.pool", "pre-logits")
    layer = index.provenance.get("vitkit.embed.layer", "final")
    return EmbedSettings(pool=None if pool == "pre-logits" else pool, layer=None if layer == "final" else int(layer),
                         precision=index.provenance.get(PRECISION, "fp32"), progress=False)  # fmt: skip


@dataclass
class Queries:
    """Query vectors with a label each (a path, ``id:ID``) and, for ids, the id to leave out of its neighbours."""

    labels: list[str] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    exclude: list[str | None] = field(default_factory=list)


def checkpoint_meta(loaded: Any) -> dict[str, str]:
    """The provenance keys of a loaded checkpoint that an index compares (weights digest, preprocessing)."""
    from vitkit.checkpoints.loaded import state_digest

    return {
        CHECKPOINT: state_digest(loaded.model.state_dict()),
        PREPROCESS: json.dumps(dataclasses.asdict(loaded.meta.preprocess), sort_keys=True),
    }


def query_vectors(
    index: Index, queries: Sequence[str], *, vectors: str | None = None, checkpoint: str | None = None,
    settings: EmbedSettings | None = None,
) -> Queries:  # fmt: skip
    """The vectors of ``queries`` (``id:ID``: the indexed vector; anything else: image files, folders or patterns,
    embedded with the index's checkpoint and options) and of the embedding output ``vectors``; a checkpoint or
    file made otherwise than the index is refused in one line."""
    out = Queries()
    images: list[int] = []  # the slots of image queries, in the order given, filled once they are embedded
    for q in queries:
        if q.startswith("id:"):
            out.labels.append(q)
            out.vectors.append(index.vector(q[3:]))
            out.exclude.append(q[3:])
        else:
            from vitkit.data.stream import list_inputs

            for path in list_inputs([q]):
                images.append(len(out.labels))
                out.labels.append(path)
                out.vectors.append(np.zeros(0, np.float32))
                out.exclude.append(None)
    if images:
        from vitkit.checkpoints import load_checkpoint
        from vitkit.inference.embed import embed

        ckpt = checkpoint or index.provenance.get(CHECKPOINT_SOURCE)
        if ckpt is None:
            raise ConfigError("image queries need the index's checkpoint: give it with -c")
        s = settings or settings_of(index)
        loaded = load_checkpoint(ckpt, format=s.format)
        found = {**checkpoint_meta(loaded), "vitkit.embed.pool": index.provenance.get("vitkit.embed.pool", ""),
                 "vitkit.embed.layer": index.provenance.get("vitkit.embed.layer", "")}  # fmt: skip
        index.check_comparable({**index.provenance, **found}, f"-c {ckpt}")
        e = embed(loaded, [out.labels[i] for i in images], pool=s.pool, layer=s.layer, batch_size=s.batch_size,
                  precision=s.precision, device=s.device)  # fmt: skip
        shape = json.dumps(list(e.vectors.shape[1:]))
        if index.provenance.get("vitkit.embed.shape", shape) != shape:
            raise DataError(f"-c {ckpt}: vectors of shape {shape}, the index holds "
                            f"{index.provenance['vitkit.embed.shape']}")  # fmt: skip
        for slot, v in zip(images, e.vectors, strict=True):
            out.vectors[slot] = np.asarray(v, dtype=np.float32)
    if vectors is not None:
        e = read_embeddings(vectors)
        index.check_comparable(e.meta, f"--vectors {vectors}")
        if e.vectors.ndim != 2:
            raise DataError(f"--vectors {vectors}: one vector per image is needed (not --pool tokens)")
        for i, name in enumerate(e.ids):
            if i not in e.errors:
                out.labels.append(name)
                out.vectors.append(np.asarray(e.vectors[i], dtype=np.float32))
                out.exclude.append(None)
    if not out.labels:
        raise ConfigError("give queries: images, a folder, id:ID, or --vectors FILE")
    return out


def search_index(index: Index, q: Queries, k: int) -> list[dict[str, Any]]:
    """One row per query: ``{"query": label, "neighbours": [{"id", "score"}, ...]}``."""
    hits: list[list[Hit]] = index.search(np.stack(q.vectors), k + 1) if q.vectors else []
    rows = []
    for label, skip, row in zip(q.labels, q.exclude, hits, strict=True):
        kept = [h for h in row if h.id != skip][:k]
        rows.append({"query": label, "neighbours": [{"id": h.id, "score": round(h.score, 6)} for h in kept]})
    return rows


def write_results(rows: list[dict[str, Any]], out: str | os.PathLike[str]) -> Path:
    """Search results as JSONL (one query a line) or CSV (query, rank, id, score), written atomically."""
    p = Path(out)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    elif suffix == ".csv":
        ranked = ([r["query"], rank, n["id"], n["score"]] for r in rows for rank, n in enumerate(r["neighbours"], 1))
        text = csv_text([["query", "rank", "id", "score"], *ranked])
    else:
        raise ConfigError(f"--out {out}: write search results to .jsonl or .csv")
    return write_text_atomic(p, text)


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    """Search results as the lines of a text table (per query: rank, score, id)."""
    lines = [f"{'rank':>4}  {'score':>8}  id"]
    for r in rows:
        lines.append(f"query {r['query']}")
        lines += [f"{rank:>4}  {n['score']:8.4f}  {n['id']}" for rank, n in enumerate(r["neighbours"], 1)]
    return lines


def write_groups(index: Index, found: Any, out: str | os.PathLike[str]) -> Path:
    """Near-duplicate groups as CSV: ``group``, ``image``, ``score`` (the representative first, score 1)."""
    p = Path(out)
    if p.suffix.lower() != ".csv":
        raise ConfigError(f"--out {out}: dedup writes its groups as .csv")
    groups = enumerate(zip(found.groups, found.scores, strict=True))
    members = ([g, index.ids[m], f"{s:.6f}"] for g, (ms, ss) in groups for m, s in zip(ms, ss, strict=True))
    return write_text_atomic(p, csv_text([["group", "image", "score"], *members]))
