"""Peak memory of ``vitkit embed`` locally and with ``--ray`` (issue 45's memory goal): each job run as a
subprocess (``python -m vitkit embed``), the memory of its whole process tree (the driver and, under ``--ray``,
the local cluster it starts: GCS, raylet, workers, actors) summed every 50 ms (RSS and PSS), the peaks reported.
The same JPEGs and a random S/16 at 224 px as tools/ray_overhead.py.

    python tools/ray_memory.py --images 256
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """The summed RSS and PSS (shared pages split between the processes mapping them: PyTorch's libraries in
    every Ray worker, the object store's shared memory, counted once) of ``root`` and its descendants."""
    rss = pss = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            m = p.memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
    return rss, pss


def peak(argv: list[str]) -> tuple[int, int, float]:
    start = time.perf_counter()
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root, rss, pss = psutil.Process(job.pid), 0, 0
    while job.poll() is None:
        with contextlib.suppress(psutil.Error):
            r, p = tree_memory(root)
            rss, pss = max(rss, r), max(pss, p)
        time.sleep(0.05)
    assert job.returncode == 0, argv
    return rss, pss, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    args = ap.parse_args()
    import vitkit
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.models import create_model

    root = Path(tempfile.mkdtemp(prefix="vitkit-ray-mem-"))
    rng = np.random.default_rng(0)
    (root / "in").mkdir()
    for i in range(args.images):
        small = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
        Image.fromarray(small).resize((320, 256), Image.BILINEAR).save(root / "in" / f"{i:05d}.jpg", quality=90)
    ckpt = vitkit.save_pretrained(create_model("S/16", num_classes=10).eval(), root / "m",
                                  preprocess=Preprocess(image_size=224))  # fmt: skip
    base = [sys.executable, "-m", "vitkit", "embed", str(ckpt), str(root / "in"), "--batch-size", "32"]
    for name, extra in (("local", []), ("ray", ["--ray"])):
        rss, pss, wall = peak([*base, "--out", str(root / f"{name}.npy"), *extra])
        print(f"{name:5s}: peak of the process tree: RSS {rss / 2**20:5.0f} MiB, PSS {pss / 2**20:5.0f} MiB "
              f"({wall:.1f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
