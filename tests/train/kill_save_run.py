"""Worker for the kill-during-save test: ``kill_save_run.py RUN_DIR POINT``.

Trains the tiny digits config, saving training state every 3 steps. In its second save (step 6) it stops at
POINT -- ``mid-write``: half of ``state.safetensors`` written and fsync'ed; ``before-rename``: the new state
complete in its hidden temporary folder, not yet renamed into place -- prints one line saying so, and waits
on stdin: the test SIGKILLs it there. The hook is this script's own (it wraps two functions of
``vitkit.train.state`` in this process only); vitkit has no switch for it. Should the test go away (stdin
closes), the save completes and the run finishes normally.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save
from train_helpers import tiny_config

from vitkit import fileio
from vitkit.train import state, train


def main() -> None:
    run, point = Path(sys.argv[1]), sys.argv[2]
    real_save, real_replace = state.save_file, fileio.replace_dir
    saves = 0

    def stop(line: str) -> None:
        print(line, flush=True)
        sys.stdin.read()  # SIGKILLed here

    def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        nonlocal saves
        saves += 1
        if point != "mid-write" or saves != 2:
            real_save(tensors, filename, metadata)
            return
        data = save(tensors, metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            stop(f"writing {filename} {len(data)}")
            f.write(data[len(data) // 2 :])

    def replace_dir(tmp: Path, final: Path) -> None:
        if point == "before-rename" and saves == 2:
            stop(f"renaming {tmp}")
        real_replace(tmp, final)

    state.save_file = save_file  # type: ignore[assignment]
    fileio.replace_dir = replace_dir  # type: ignore[assignment]  # what fileio.write_dir_atomic calls
    train(tiny_config(checkpoint_every_steps=3), run, progress=False)


if __name__ == "__main__":
    main()
