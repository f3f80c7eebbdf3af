"""Peak memory of ``vitkit embed`` locally and with ``--ray`` (issue 45's memory goal): each job run as a
subprocess (``python -m vitkit embed``), the memory of its whole process tree (the driver and, under ``--ray``,
the local cluster it starts: GCS, raylet, agents, workers, actors) summed every 50 ms (RSS and PSS), the peaks
reported, with the PSS of each kind of process at the moment of the PSS peak (``--by-process``). The same JPEGs
and a random S/16 at 224 px as tools/ray_overhead.py.

    python tools/ray_memory.py --images 256 --by-process
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

# (a word of the process's command line, the name reported), first match wins
KINDS = [
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard/agent.py", "dashboard agent"),
    ("runtime_env/agent", "runtime env agent"),
    ("log_monitor", "log monitor"),
    ("dashboard/dashboard.py", "dashboard"),
    ("monitor.py", "autoscaler monitor"),
    ("ray::IDLE", "idle worker"),
    ("MapWorker", "model actor"),
    ("_StatsActor", "Ray Data stats actor"),
    ("ray::", "task worker"),
    ("default_worker.py", "worker (starting)"),
    ("-m vitkit", "driver"),
]


def kind(p: psutil.Process) -> str:
    line = " ".join(p.cmdline())
    return next((name for word, name in KINDS if word in line), "other: " + line[:60])


def tree_memory(root: psutil.Process) -> tuple[int, int, dict[str, list[int]]]:
    """The summed RSS and PSS (shared pages split between the processes mapping them: PyTorch's libraries in
    every Ray worker, the object store's shared memory, counted once) of ``root`` and its descendants, and the
    PSS of each process by its kind."""
    rss = pss = 0
    each: dict[str, list[int]] = collections.defaultdict(list)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            m = p.memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
            each[kind(p)].append(m.pss)
    return rss, pss, each


def peak(argv: list[str]) -> tuple[int, int, float, dict[str, list[int]]]:
    start = time.perf_counter()
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root, rss, pss, at_peak = psutil.Process(job.pid), 0, 0, {}
    while job.poll() is None:
        with contextlib.suppress(psutil.Error):
            r, p, each = tree_memory(root)
            if p > pss:
                at_peak = each
            rss, pss = max(rss, r), max(pss, p)
        time.sleep(0.05)
    assert job.returncode == 0, argv
    return rss, pss, time.perf_counter() - start, at_peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--by-process", action="store_true", help="the PSS of each kind of process at the PSS peak")
    ap.add_argument("--ray-only", action="store_true", help="only the --ray job")
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
    jobs = (("ray", ["--ray"]),) if args.ray_only else (("local", []), ("ray", ["--ray"]))
    for name, extra in jobs:
        rss, pss, wall, each = peak([*base, "--out", str(root / f"{name}.npy"), *extra])
        print(f"{name:5s}: peak of the process tree: RSS {rss / 2**20:5.0f} MiB, PSS {pss / 2**20:5.0f} MiB "
              f"({wall:.1f} s)", flush=True)  # fmt: skip
        if args.by_process:
            for what, values in sorted(each.items(), key=lambda kv: -sum(kv[1])):
                print(f"    {what:22s} x{len(values)}: PSS {sum(values) / 2**20:5.0f} MiB "
                      f"({', '.join(f'{v / 2**20:.0f}' for v in values)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
