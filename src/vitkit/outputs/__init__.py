"""Resumable outputs: one crash-safe chunk store (:mod:`~vitkit.outputs.store`: a parts folder written by rename,
one lock, one pre-check, resume with metadata checks, deleting only its own files) and the assemblers on it:
rows (:mod:`~vitkit.outputs.rows`: JSONL, CSV, Parquet), arrays (:mod:`~vitkit.outputs.arrays`: Parquet, .npy,
.safetensors; read back by :mod:`~vitkit.outputs.array_reader`) and the feature cache's chunks
(:mod:`vitkit.train.feature_cache`). Below inference and train, which both write through it."""
