"""What an output of a batch job was made from, stored with it and compared on ``--resume`` (and by ``knn`` and
``fewshot`` between their train and test embeddings), so that rows of two checkpoints, two precisions or two
inputs never end up in one file.

An output records (string values, under these keys: Parquet schema metadata, ``meta.json`` of an embedding
output's chunks and its finished file, the ``NAME.vitkit.json`` mark beside a JSONL/CSV file):

- ``vitkit.checkpoint``: the SHA-256 of the weights (:func:`~vitkit.checkpoints.loaded.state_digest`: names,
  shapes, dtypes and values, whatever file they came from);
- ``vitkit.precision`` and ``vitkit.backend``: as asked (``auto`` stays ``auto``: resolving it here would time
  a GEMM, and a choice by timing may differ between two runs of one job);
- ``vitkit.preprocess``: the checkpoint's preprocessing (resize, crop, mean/std...), JSON;
- ``vitkit.input``: where the input's ids are rooted (JSON): image files given by relative paths are rooted in
  the working directory, which relative ids alone cannot tell apart. The ids themselves are compared row by row
  (:func:`vitkit.inference.jobs.check_resume`), so an input may grow at its end and still resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from vitkit.checkpoints import Loaded
from vitkit.checkpoints.loaded import state_digest
from vitkit.data.stream import FileSource, ImageSource
from vitkit.outputs.store import BACKEND, CHECKPOINT, INPUT, PRECISION, PREPROCESS, check_same

MODEL_KEYS = (CHECKPOINT, PRECISION, BACKEND, PREPROCESS)  # what makes two outputs' numbers comparable


def input_fingerprint(source: ImageSource) -> str:
    """Where ``source``'s ids are rooted (JSON): for image files the working directory when any path is relative
    (none: ids are absolute); for a dataset its type and the working directory (dataset ids may be relative)."""
    if isinstance(source, FileSource):
        relative = any(not os.path.isabs(p) for p in source.paths)
        return json.dumps({"kind": "files", "base": os.getcwd() if relative else ""})
    kind = type(getattr(source, "dataset", source)).__name__
    return json.dumps({"kind": f"dataset:{kind}", "base": os.getcwd()})


def job_meta(loaded: Loaded, source: ImageSource, *, precision: str, backend: str) -> dict[str, str]:
    """The provenance of a job's output (see the module docstring)."""
    return {
        CHECKPOINT: state_digest(loaded.model.state_dict()),
        PRECISION: precision,
        BACKEND: backend,
        PREPROCESS: json.dumps(dataclasses.asdict(loaded.meta.preprocess), sort_keys=True),
        INPUT: input_fingerprint(source),
    }


COMPARABLE = (*MODEL_KEYS, "vitkit.embed.pool", "vitkit.embed.layer", "vitkit.embed.l2", "vitkit.embed.shape")


def check_comparable(train: Mapping[str, str], test: Mapping[str, str], train_where: str, test_where: str) -> None:
    """DataError naming the test file when the train and test embeddings were made by another checkpoint,
    precision, preprocessing or pooling (:data:`COMPARABLE`; the input differs by nature)."""
    check_same(test, train, test_where, COMPARABLE, advice="embed both with the same checkpoint and options",
               against=train_where)  # fmt: skip
