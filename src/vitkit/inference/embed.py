"""Features for search, clustering and probes: ``vitkit.embed(...)`` in Python, and :func:`embed_job` behind
``vitkit embed`` (any number of images, streamed, written to Parquet, ``.npy`` or ``.safetensors`` batch by batch,
resumable; :mod:`vitkit.outputs.arrays`).

What a vector is (:class:`EmbedOptions`):

- by default the pre-logits features: the model's pooled token after its optional pre-logits layer, the
  representation the paper's linear probes and few-shot evaluation use (``forward_head(tokens, pre_logits=True)``);
- ``pool="cls"``: the class token, ``"gap"``: the mean of the patch tokens (prefix tokens, registers included,
  left out), ``"cls+gap"``: the two concatenated (2D: the features DINOv2's linear probes read),
  ``"tokens"``: every token (T, D); of the final normed tokens, or with ``layer`` of that block's output;
- ``layer=N``: the output of transformer block N (1..L; -1 the last), before the final norm, pooled by ``pool``
  (default: the model's own pooling, the class token or the mean of all tokens). The reference path (``--precision
  fp32``) takes it from the model's ``forward_intermediates``, the fast path runs only the first N blocks;
- ``l2``: each vector divided by its L2 norm (computed in fp32); ``dtype``: fp32 or fp16 storage.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.data.stream import DatasetSource, ImageSource, StreamBatch
from vitkit.distributed import DistInfo
from vitkit.errors import ConfigError, VitkitError
from vitkit.images import ImageInput
from vitkit.inference.engine import POOLS, InferenceEngine
from vitkit.inference.jobs import Collect, EngineSpec, Job, JobSummary, Steps, image_source, run_job
from vitkit.inference.provenance import job_meta
from vitkit.outputs.array_reader import Embeddings
from vitkit.outputs.arrays import DTYPES, EmbeddingWriter


@dataclass(frozen=True)
class EmbedOptions:
    """What ``vitkit embed`` computes (``pool``: None for the pre-logits features, or cls/gap/tokens; ``layer``:
    None for the final tokens, or a block 1..L, negative from the end; ``dtype`` fp32/fp16 storage; ``l2``
    normalisation) and how (engine precision, device, batch, decoding workers and prefetch, ``skip_bad``)."""

    pool: str | None = None
    layer: int | None = None
    dtype: str = "fp32"
    l2: bool = False
    batch_size: int = 32
    precision: str = "auto"
    device: str = "cpu"
    workers: int = 0
    prefetch: int = 2
    skip_bad: bool = False
    progress: bool = True
    decode: str = "auto"  # cpu, gpu or auto: where JPEGs are decoded (vitkit.inference.jobs.plan_decode)

    def check(self, depth: int, class_token: bool) -> None:
        """ConfigError naming the option that does not fit a model of ``depth`` blocks (with a class token or not)."""
        if self.pool is not None and self.pool not in POOLS:
            raise ConfigError(f"--pool {self.pool!r}: choose one of {', '.join(POOLS)}")
        if self.pool in ("cls", "cls+gap") and not class_token:
            raise ConfigError(f"--pool {self.pool}: the model has no class token (GAP or MAP pooling); use --pool gap")
        if self.layer is not None and (self.layer == 0 or not -depth <= self.layer <= depth):
            raise ConfigError(f"--layer {self.layer}: the model has {depth} blocks (1..{depth}, or -1 for the last)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose fp32 or fp16")

    def meta(self) -> dict[str, str]:
        """The options as stored in the output (a resumed output must match them)."""
        return {
            "vitkit.embed.pool": self.pool or "pre-logits",
            "vitkit.embed.layer": "final" if self.layer is None else str(self.layer),
            "vitkit.embed.dtype": self.dtype,
            "vitkit.embed.l2": json.dumps(self.l2),
        }


@torch.inference_mode()
def embedding_vectors(engine: InferenceEngine, x: torch.Tensor, opts: EmbedOptions) -> torch.Tensor:
    """Images (B, C, H, W), preprocessed -> the vectors ``opts`` asks for, float32 on the CPU: (B, R), or
    (B, T, D) for ``pool="tokens"`` (L2-normalised over the last dimension with ``opts.l2``): the engine's
    :meth:`~vitkit.inference.engine.InferenceEngine.features` at ``opts.layer`` pooled by ``opts.pool``."""
    out = engine.features(x, layer=opts.layer, pool=opts.pool)
    if opts.l2:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out


def embed_columns(
    engine: InferenceEngine, batch: StreamBatch, opts: EmbedOptions, shape: tuple[int, ...]
) -> dict[str, Any]:
    """One batch through the engine as the columns :class:`~vitkit.outputs.arrays.EmbeddingWriter` takes (a
    failed image: NaN)."""
    vectors = np.full((len(batch), *shape), np.nan, dtype=DTYPES[opts.dtype])
    if batch.images.numel():
        vectors[batch.ok] = embedding_vectors(engine, batch.images, opts).numpy().astype(vectors.dtype)
    return {
        "index": batch.positions,
        "id": list(batch.ids),
        "label": batch.labels,
        "vector": vectors,
        "error": [e or "" for e in batch.errors],
    }


def vector_shape(loaded: Loaded, opts: EmbedOptions) -> tuple[int, ...]:
    """The shape of one vector: (R,), (D,), or (T, D) for tokens."""
    cfg = loaded.model.cfg
    if opts.pool == "tokens":
        return (cfg.num_tokens(loaded.meta.preprocess.image_size), cfg.hidden_size)
    if opts.pool is None and opts.layer is None:
        return (loaded.model.num_features,)
    return (2 * cfg.hidden_size,) if opts.pool == "cls+gap" else (cfg.hidden_size,)


def embed_job(
    loaded: Loaded,
    source: ImageSource,
    opts: EmbedOptions,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_engine: Callable[[InferenceEngine], None] | None = None,
    dist: DistInfo | None = None,
    steps: Steps | None = None,
) -> JobSummary:
    """``vitkit embed``: every image of ``source`` through the engine, its vector (:func:`embedding_vectors`)
    written to ``out`` batch by batch (:class:`~vitkit.outputs.arrays.EmbeddingWriter`; ``resume`` continues
    an interrupted run, ``overwrite`` starts it again). ``dist``: the processes of a ``torchrun`` job, each
    embedding its share of the images, process 0 writing them in input order. ``steps``: what runs the batches
    (:func:`vitkit.ray.steps`: the same job on a Ray cluster, the same file written)."""
    info = dist or DistInfo()
    cfg = loaded.model.cfg
    opts.check(cfg.depth, bool(cfg.class_token))
    shape = vector_shape(loaded, opts)
    meta = {**opts.meta(), "vitkit.embed.shape": json.dumps(list(shape))}
    if info.is_main:  # what the vectors were made from, compared on --resume and by knn/fewshot
        meta.update(job_meta(loaded, source, precision=opts.precision, backend="torch"))
    sink = EmbeddingWriter(out, meta, resume=resume, overwrite=overwrite) if info.is_main else None
    job = Job(source, EngineSpec.of(loaded, precision=opts.precision, device=opts.device), opts.batch_size,
              workers=opts.workers, prefetch=opts.prefetch, skip_bad=opts.skip_bad, decode=opts.decode,
              progress=opts.progress, desc="embed", where=f"--out {out}", on_engine=on_engine, dist=info)  # fmt: skip
    try:
        summary = run_job(job, lambda engine, batch: embed_columns(engine, batch, opts, shape), sink, steps)
        if sink is not None:  # on an error the chunks written so far stay, for --resume
            sink.close()
    finally:
        if sink is not None:
            sink.release()
    return summary


def embed(
    checkpoint: str | os.PathLike[str] | Loaded,
    images: Iterable[ImageInput] | Any,
    *,
    pool: str | None = None,
    layer: int | None = None,
    l2: bool = False,
    dtype: str = "fp32",
    batch_size: int = 32,
    format: str | None = None,
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    workers: int = 0,
    progress: bool = False,
) -> Embeddings:
    """Embeddings of images (file paths or PIL images) or of a dataset (``vitkit.open_dataset(...)``, labels
    kept), in memory, in input order: :class:`~vitkit.outputs.array_reader.Embeddings` (``vectors`` (N, R) or
    (N, T, D), ``ids``, ``labels``). ``pool``, ``layer``, ``l2``, ``dtype``: as :class:`EmbedOptions`;
    ``precision``: ``fp32`` (default: the checkpoint's own model), ``auto``, ``bf16`` or ``int8``. For outputs
    larger than memory, use ``vitkit embed`` (or :func:`embed_job`), which writes them to a file as it goes."""
    loaded = checkpoint if isinstance(checkpoint, Loaded) else load_checkpoint(checkpoint, format=format)
    opts = EmbedOptions(pool=pool, layer=layer, dtype=dtype, l2=l2, batch_size=batch_size, precision=precision)
    opts.check(loaded.model.cfg.depth, bool(loaded.model.cfg.class_token))
    shape = vector_shape(loaded, opts)
    engine = EngineSpec.of(loaded, precision=precision, device=device).build(batch_size, None)
    is_dataset = hasattr(images, "__getitem__") and hasattr(images, "classes")
    source = DatasetSource(images) if is_dataset else image_source(images)
    job = Job(source, EngineSpec.of_engine(engine), batch_size, workers=workers, progress=progress, desc="embed")
    got = Collect()
    run_job(job, lambda engine, batch: embed_columns(engine, batch, opts, shape), got)
    cols = got.columns()
    if not cols:
        raise VitkitError("no images to embed")
    return Embeddings(
        ids=cols["id"], index=cols["index"], labels=cols["label"], vectors=cols["vector"], meta=opts.meta()
    )
