"""Worker for the sharding test: ``[torchrun --nproc_per_node N] shard_run.py OUT CKPT DATA`` runs ``vitkit
predict``, ``embed``, ``eval`` and ``knn`` over the ImageFolder DATA, writing into OUT (process 0)."""

from __future__ import annotations

import sys
from pathlib import Path

from vitkit.cli import main


def run() -> None:
    out, ckpt, data = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    common = ["--precision", "fp32", "--batch-size", "2", "--workers", "0", "--device", "cpu"]
    for argv in (
        ["predict", "-c", ckpt, "--data", data, "--split", "test", "--out", str(out / "pred.jsonl"), "--logits"],
        ["embed", ckpt, "--data", data, "--split", "test", "--out", str(out / "emb.npy")],
        ["embed", ckpt, "--data", data, "--split", "test", "--out", str(out / "tokens.parquet"), "--pool", "tokens"],
        ["eval", ckpt, "--data", data, "--split", "test", "--out", str(out / "eval")],
        ["knn", ckpt, "--data", data, "-k", "3", "--out", str(out / "knn.json")],
    ):
        code = main([*argv, *common])
        if code != 0:
            sys.exit(code)


if __name__ == "__main__":
    run()
