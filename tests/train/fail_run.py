"""Worker for the failure tests: ``fail_run.py OUT STRATEGY FAIL_RANK FAIL_STEP [SIGTERM]``.

Trains the tiny digits config; process FAIL_RANK raises a one-line DataError after step FAIL_STEP while the
others go on into the next step's collectives. Each process writes OUT/rank<r>.txt: its error and when;
OUT/raised holds when the error was raised.
SIGTERM reproduces torchrun's agent stopping the others around the failed process's exit: "peer" -- the
failed process sends it to process 1 - FAIL_RANK as it exits (atexit: its connections are still open, so
that process is still inside a collective); "self" -- the other process sends it to itself after the
trainer has raised, before writing its report (the agent's signal arriving late).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

from train_helpers import tiny_config

from vitkit.errors import DataError, VitkitError
from vitkit.train.trainer import Trainer


def main() -> None:
    out, strategy, fail_rank, fail_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sigterm = sys.argv[5] if len(sys.argv) > 5 else "none"
    cfg = tiny_config(distributed=strategy, epochs=4, device="cpu")  # gloo processes, whatever GPUs are here

    def hook(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.dist.rank == fail_rank and trainer.step == fail_step:
            if sigterm == "peer":
                peer = int((out / f"pid{1 - fail_rank}").read_text())
                atexit.register(os.kill, peer, signal.SIGTERM)
            (out / "raised").write_text(str(time.time()))
            raise DataError("bad.png: injected corrupt image")

    rank = "?"
    try:
        with Trainer(cfg, out / "run", progress=False) as trainer:
            rank = str(trainer.dist.rank)
            (out / f"pid{rank}").write_text(str(os.getpid()))
            trainer.fit(on_step=hook)
    except VitkitError as e:
        if sigterm == "self" and rank != str(fail_rank):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        (out / f"rank{rank}.txt").write_text(f"{time.time()}\n{e}\n")
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
