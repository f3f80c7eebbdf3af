"""Feeds the table "A busy machine" of BENCHMARKS.md (``python benchmarks/run_all.py busy``): the default job
(``vitkit train``) and a short ``vitkit finetune`` of its model, each on a quiet machine and beside one
CPU-bound program (``python -c 'while True: pass'``, not a child of the job), with vitkit's own thread choice
and with ``OMP_NUM_THREADS=1``; issue 48's goal: with the competitor, the default <= 1.3x the better of the two,
and the quiet figures unchanged.

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/busy_machine.py
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=/path/to/old/src python benchmarks/busy_machine.py  # the code before

Each figure is one whole command's wall time (start, import, training, the test pass), in a fresh process, the
four conditions of one job run back to back. Results go to ``--json FILE`` (as ``run_all.py`` runs it) or
benchmarks/results/busy.json; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CONDITIONS = [("quiet", "default"), ("quiet", "1 thread"), ("busy", "default"), ("busy", "1 thread")]


def competitor() -> int:
    """The pid of a CPU-bound program started through a shell, so that it is no child of this process or the job."""
    spawn = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", spawn], capture_output=True, text=True, check=True).stdout)


def timed(cmd: list[str], threads: str) -> tuple[float, str]:
    """Wall seconds of ``cmd`` and its stderr's note about other programs (if it printed one)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads == "1 thread":
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    note = next((line for line in done.stderr.splitlines() if "other programs are using" in line), "")
    return seconds, note


def measure(name: str, job: Callable[[str], list[str]]) -> dict[str, object]:
    """The job (a command for a new run folder's name) in the four conditions."""
    rows: dict[str, object] = {}
    for i, (load, threads) in enumerate(CONDITIONS):
        cmd = job(f"{name}-{i}")
        hog = competitor() if load == "busy" else None
        try:
            time.sleep(0.5)
            seconds, note = timed(cmd, threads)
        finally:
            if hog is not None:
                os.kill(hog, signal.SIGKILL)
        rows[f"{load}, {threads}"] = {"seconds": round(seconds, 1), "note": note}
        print(f"{name:9s} {load:5s} {threads:9s} {seconds:7.1f} s {note[:60]}", flush=True)
    best_busy = min(rows[f"busy, {t}"]["seconds"] for t in ("default", "1 thread"))  # type: ignore[index]
    rows["busy default / best busy"] = round(rows["busy, default"]["seconds"] / best_busy, 2)  # type: ignore[index]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "busy.json")
    args = ap.parse_args()
    vitkit = [sys.executable, "-m", "vitkit"]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run([*vitkit, "train", "--out", str(base), "--quiet"], check=True, capture_output=True)
        steps = str(args.finetune_steps)
        jobs: dict[str, Callable[[str], list[str]]] = {
            "train": lambda out: [*vitkit, "train", "--out", f"{tmp}/{out}", "--quiet"],
            "finetune": lambda out: [
                *vitkit,
                "finetune",
                str(base / "model"),
                "--data",
                "digits",
                "--steps",
                steps,
                "--out",
                f"{tmp}/{out}",
                "--quiet",
            ],
        }
        results = {name: measure(name, cmd) for name, cmd in jobs.items()}
    print("\n| job | quiet, default | quiet, 1 thread | busy, default | busy, 1 thread | busy default / best busy |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        cells = [f"{r[f'{a}, {b}']['seconds']} s" for a, b in CONDITIONS]  # type: ignore[index]
        print(f"| {name} | {' | '.join(cells)} | {r['busy default / best busy']}x |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
