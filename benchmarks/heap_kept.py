"""What ``heap_kept`` (vitkit.train.heap) does to a real ``fit()``: peak resident memory and time, each run a
fresh process, the allocator settings alternating run by run.

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/heap_kept.py \\
        --jobs s16 --runs 3 --steps 10 > benchmarks/results/heap_kept_s16.json

(BENCHMARKS.md, "heap_kept on a whole fit()", has the runs and the other two commands.)

Allocator settings (``--settings``), each applied around ``fit()`` exactly where the trainer applies
``heap_kept`` (the trainer's name is replaced in the fresh process; nothing else changes):

- ``glibc``: glibc's defaults (nothing changed);
- ``kept``: ``heap_kept`` as the trainer uses it (no mmap, no trimming while ``fit()`` runs);
- ``kept-mmap32``: no trimming, but blocks over 32 MiB mmapped (glibc's largest dynamic threshold), so
  only blocks up to 32 MiB are kept in the heap.

Jobs (``--jobs``):

- ``digits``: the default job, ``vitkit train`` with no options (fp32, 770 steps of batch 128, 16 px);
- ``s16``: recipe ``plain-vit-s16`` (S/16, 224 px, bf16 autocast, RandAugment, Mixup) for ``--steps``
  steps of batch 32 on random 224 px images in an .npz, no evaluation, loading in the training process
  (``--workers 0``: the measured process is the only one).

Per run: the process's wall time; ``fit()``'s own time (the "run folder: ... s" line); its peak resident
set (``ru_maxrss`` from ``wait4`` of the fresh process, and VmHWM read in it at exit); minor page faults
and system CPU time of the process. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SETTINGS = ("glibc", "kept", "kept-mmap32")

# the fresh process: the trainer's heap_kept replaced by the setting, then `vitkit train ARGS`
CHILD = """
import contextlib, importlib, json, sys
trainer = importlib.import_module("vitkit.train.trainer")  # vitkit.train is also the API's train()
heap = importlib.import_module("vitkit.train.heap")

setting, out = sys.argv[1], sys.argv[2]

@contextlib.contextmanager
def mmap32():
    libc = heap._glibc()
    libc.mallopt(heap.M_TRIM_THRESHOLD, heap.TRIM_KEEP)
    libc.mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_MAX)
    try:
        yield True
    finally:
        libc.mallopt(heap.M_TRIM_THRESHOLD, 2 * heap.MMAP_THRESHOLD_MAX)
        libc.malloc_trim(0)

if setting == "glibc":
    trainer.heap_kept = lambda: contextlib.nullcontext(False)
elif setting == "kept-mmap32":
    trainer.heap_kept = mmap32
from vitkit.cli import main

code = main(sys.argv[3:])
status = open("/proc/self/status").read()
hwm = int(next(l for l in status.splitlines() if l.startswith("VmHWM:")).split()[1])
open(out, "w").write(json.dumps({"code": code, "vmhwm_kib": hwm}))
"""


def random_images(tmp: Path) -> None:
    """256 random 224 px RGB images of 10 classes, the s16 job's data."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (256, 224, 224, 3), dtype=np.uint8)
    np.savez(tmp / "random.npz", train_images=images, train_labels=rng.integers(0, 10, 256))


def job_args(job: str, tmp: Path, steps: int, out_dir: Path) -> list[str]:
    out = ["--quiet", "--out", str(out_dir)]
    if job == "digits":
        return ["train", *out]
    return [
        "train", "--recipe", "plain-vit-s16", "--data", str(tmp / "random.npz"), "--batch-size", "32",
        "--steps", str(steps), "--workers", "0", "--set", "data.val_split=null",
        "--set", f"optim.warmup_steps={steps // 4}", *out,
    ]  # fmt: skip


def one_run(setting: str, args: list[str], tmp: Path) -> dict[str, float]:
    result = tmp / "child.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, setting, str(result), *args], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{setting} {args}: exit status {proc.returncode}")
    child = json.loads(result.read_text())
    fit = re.search(r"run folder: .* \((\d+) steps, ([\d.]+) s\)", stdout)
    assert fit, stdout
    return {
        "wall_s": round(wall, 2),
        "fit_s": float(fit.group(2)),
        "steps": int(fit.group(1)),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "vmhwm_mib": round(child["vmhwm_kib"] / 1024, 1),
        "minor_faults": usage.ru_minflt,
        "system_s": round(usage.ru_stime, 2),
        "user_s": round(usage.ru_utime, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", choices=("digits", "s16"), default=["s16", "digits"])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting, alternating")
    parser.add_argument("--steps", type=int, default=8, help="steps of the s16 job")
    opts = parser.parse_args()
    report: dict[str, object] = {"python": platform.python_version(), "cpu": _cpu(), "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="vitkit-heap-") as name:
        tmp = Path(name)
        random_images(tmp)
        for job in opts.jobs:
            runs: dict[str, list[dict[str, float]]] = {s: [] for s in opts.settings}
            for r in range(opts.runs):
                order = opts.settings if r % 2 == 0 else opts.settings[::-1]  # none always goes first
                for setting in order:
                    out_dir = tmp / "run"
                    row = one_run(setting, job_args(job, tmp, opts.steps, out_dir), tmp)
                    shutil.rmtree(out_dir)  # the run's weights and checkpoints (hundreds of MB for S/16)
                    runs[setting].append(row)
                    print(job, setting, row, file=sys.stderr, flush=True)
            summary = {s: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for s, rows in runs.items()}
            command = ["vitkit", *job_args(job, Path("TMP"), opts.steps, Path("TMP/run"))]
            report["jobs"][job] = {"command": " ".join(command), "runs": runs, "median": summary}  # type: ignore[index]
    print(json.dumps(report, indent=1))


def _cpu() -> str:
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    family, model = fields.get("CPU family"), fields.get("Model")
    return f"{fields.get('Model name')}, CPU family {family} model {model}, {os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
