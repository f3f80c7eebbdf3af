"""Worker for the multi-process tests: ``torchrun --nproc_per_node N ddp_run.py OUT STRATEGY [EVAL_BATCH [select]]``.

Trains the tiny digits config (``select``: keeping the best weights on a held-out slice, ``SELECT``) and, on process
0, writes the per-step losses, the top-1 and the step kept to OUT/losses.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from train_helpers import tiny_config

from vitkit.train import train

SELECT = {"adapt.select": True, "adapt.eval_every_steps": 3}


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    eval_batch = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    cfg = tiny_config(
        **{"distributed": strategy, "ema_decay": 0.9, "aug.randaug_layers": 1, "aug.randaug_magnitude": 5,
           "data.eval_batch_size": eval_batch, "device": "cpu"}  # gloo processes, whatever GPUs are here
    )  # fmt: skip
    if sys.argv[4:5] == ["select"]:
        cfg = cfg.override(**SELECT)
    result = train(cfg, out, progress=False)
    if result.rank == 0:
        rows = [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in result.steps]
        doc = {"steps": rows, "top1": result.final_top1, "selected_step": result.selected_step}
        (out / "losses.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
