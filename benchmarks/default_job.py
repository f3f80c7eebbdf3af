"""Feeds the table "The default job: vitkit train" of BENCHMARKS.md (``python benchmarks/run_all.py default_job``).

The README's main job, ``vitkit train`` (recipe ``digits``), once per seed, each in a fresh process as a user
runs it: test top-1 from the run's summary line, the training time the command prints, and the wall time of
the whole command (Python start-up and imports included).

    PYTHONPATH=src python benchmarks/default_job.py [--seeds 0 1 2 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCURACY = re.compile(r"accuracy: ([0-9.]+)% \((\d+)/(\d+)\)")
RUN_TIME = re.compile(r"\((\d+) steps, ([0-9.]+) s\)")


def run_seed(seed: int, out: Path) -> dict[str, float | int]:
    """One ``vitkit train --seed SEED`` in its own process: top-1, printed run time, wall time."""
    cmd = [sys.executable, "-m", "vitkit", "train", "--seed", str(seed), "--quiet", "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
    wall = time.perf_counter() - t0
    acc, steps = ACCURACY.search(done.stdout), RUN_TIME.search(done.stdout)
    if acc is None or steps is None:
        raise SystemExit(f"vitkit train printed no summary:\n{done.stdout}\n{done.stderr}")
    return {
        "seed": seed,
        "test_top1": float(acc.group(1)) / 100,
        "correct": int(acc.group(2)),
        "test_images": int(acc.group(3)),
        "steps": int(steps.group(1)),
        "run_seconds": float(steps.group(2)),
        "wall_seconds": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            r = run_seed(seed, Path(tmp) / f"seed{seed}")
            runs.append(r)
            print(
                f"seed {seed}: test top-1 {100 * r['test_top1']:.2f}% ({r['correct']}/{r['test_images']}), "
                f"{r['run_seconds']:.1f} s run, {r['wall_seconds']:.1f} s wall",
                flush=True,
            )
    top1 = [float(r["test_top1"]) for r in runs]
    report = {
        "runs": runs,
        "mean_test_top1": statistics.mean(top1),
        "lowest_test_top1": min(top1),
        "wall_seconds_range": [
            min(float(r["wall_seconds"]) for r in runs),
            max(float(r["wall_seconds"]) for r in runs),
        ],
    }
    print(f"mean {100 * report['mean_test_top1']:.2f}%, lowest {100 * report['lowest_test_top1']:.2f}%")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
