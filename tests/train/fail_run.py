"""Worker for the failure tests: ``fail_run.py OUT STRATEGY FAIL_RANK FAIL_STEP``.

Trains the tiny digits config; process FAIL_RANK raises a one-line DataError after step FAIL_STEP while the
others go on into the next step's collectives. Each process writes OUT/rank<r>.txt: its error and when.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from train_helpers import tiny_config

from vitkit.errors import DataError, VitkitError
from vitkit.train.trainer import Trainer


def main() -> None:
    out, strategy, fail_rank, fail_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = tiny_config(distributed=strategy, epochs=4)

    def hook(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.dist.rank == fail_rank and trainer.step == fail_step:
            raise DataError("bad.png: injected corrupt image")

    rank = "?"
    try:
        with Trainer(cfg, out / "run", progress=False) as trainer:
            rank = str(trainer.dist.rank)
            trainer.fit(on_step=hook)
    except VitkitError as e:
        (out / f"rank{rank}.txt").write_text(f"{time.time()}\n{e}\n")
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
