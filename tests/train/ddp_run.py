"""Worker for the multi-process tests: ``torchrun --nproc_per_node N ddp_run.py OUT STRATEGY [EVAL_BATCH]``.

Trains the tiny digits config and, on process 0, writes the per-step losses to OUT/losses.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from train_helpers import tiny_config

from vitkit.train import train


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    eval_batch = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    cfg = tiny_config(
        **{"distributed": strategy, "ema_decay": 0.9, "aug.randaug_layers": 1, "aug.randaug_magnitude": 5,
           "data.eval_batch_size": eval_batch, "device": "cpu"}  # gloo processes, whatever GPUs are here
    )  # fmt: skip
    result = train(cfg, out, progress=False)
    if result.rank == 0:
        rows = [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in result.steps]
        (out / "losses.json").write_text(json.dumps({"steps": rows, "top1": result.final_top1}))


if __name__ == "__main__":
    main()
