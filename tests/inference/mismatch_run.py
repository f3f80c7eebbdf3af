"""Worker for the input-agreement test: ``torchrun --nproc_per_node 2 mismatch_run.py OUT CKPT ROOT COMMAND`` runs
``vitkit predict``, ``embed`` or ``eval`` (COMMAND) on ROOT/<rank>/, a folder of its own per process: the processes list
different inputs, as on machines whose copies of a folder differ."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vitkit.cli import main


def run() -> None:
    out, ckpt, root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    mine = str(root / os.environ["RANK"])
    common = ["--precision", "fp32", "--batch-size", "2", "--workers", "0", "--device", "cpu"]
    command = sys.argv[4]
    if command == "predict":
        argv = ["predict", "-c", ckpt, mine, "--out", str(out / "pred.jsonl")]
    elif command == "embed":
        argv = ["embed", ckpt, "--data", mine, "--split", "test", "--out", str(out / "emb.npy")]
    else:  # eval: the features path (vitkit.inference.features), not the batch jobs' loop
        argv = ["eval", ckpt, "--data", mine, "--split", "test", "--out", str(out / "eval")]
    sys.exit(main([*argv, *common]))


if __name__ == "__main__":
    run()
