"""Feeds the table "Batch inference: agreement with fp32 on trained models" of BENCHMARKS.md
(``python benchmarks/run_all.py engine_agreement``): top-1 agreement of the engine's precisions with fp32
through ``vitkit predict``.

Random weights give no meaningful top-1 (nearly every image is a tie), so this runs trained checkpoints: each
``--run`` (a ``vitkit train`` run folder) goes through ``vitkit predict --data DATA --split SPLIT --precision P``
for fp32 (the checkpoint's own model, the reference), bf16 and int8 (the fast path) and auto, and the rows are
compared: accuracy against the dataset's labels, its change from fp32, and top-1 agreement with fp32. Without
``--run`` the two runs are trained first (into ``--work/runs``, kept and reused there) by::

    vitkit train --out /tmp/agree/digits                                     # the default job
    vitkit train --out /tmp/agree/b16 --image-size 64 --epochs 8 --batch-size 64 --lr 5e-4 \\
        --set model.name=B/16 --set 'model.overrides={}' --set ema_decay=null

(``--digits-epochs`` / ``--b16-epochs`` shorten them for a smoke run); the runs of BENCHMARKS.md were compared
by::

    python benchmarks/engine_agreement.py --run /tmp/agree/digits /tmp/agree/b16 --data digits --split test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8", "auto")


def predictions(run: Path, data: str, split: str, precision: str, work: Path) -> tuple[list[int], str]:
    """Top-1 class of every image by ``vitkit predict`` in ``precision`` (and the engine note it printed)."""
    out = work / f"{run.name}-{precision}.jsonl"
    cmd = [sys.executable, "-m", "vitkit", "predict", "-c", str(run), "--data", data, "--split", split,
           "--precision", precision, "--out", str(out), "--overwrite", "--top-k", "1", "--device", "cpu"]  # fmt: skip
    res = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}:\n{res.stderr[-2000:]}")
    note = next((ln for ln in res.stderr.splitlines() if ln.startswith("note: engine")), "")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [r["classes"][0] for r in rows], note.removeprefix("note: engine: ")


def train_runs(work: Path, digits_epochs: int | None, b16_epochs: int) -> list[Path]:
    """The default digits job and a briefly trained B/16 (the commands of the docstring), trained into
    ``work`` unless already there."""
    jobs = {
        "digits": [] if digits_epochs is None else ["--epochs", str(digits_epochs)],
        "b16": ["--image-size", "64", "--epochs", str(b16_epochs), "--batch-size", "64", "--lr", "5e-4",
                "--set", "model.name=B/16", "--set", "model.overrides={}", "--set", "ema_decay=null"],
    }  # fmt: skip
    runs = []
    for name, argv in jobs.items():
        run = work / name
        if not (run / "model").is_dir():
            cmd = [sys.executable, "-m", "vitkit", "train", "--out", str(run), "--quiet", *argv]
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        runs.append(run)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, nargs="+", help="trained run folders or checkpoints (default: train two)")
    p.add_argument("--digits-epochs", type=int, help="without --run: epochs of the digits job (default: recipe's)")
    p.add_argument("--b16-epochs", type=int, default=8, help="without --run: epochs of the B/16 run (default 8)")
    p.add_argument("--data", default="digits")
    p.add_argument("--split", default="test")
    p.add_argument("--work", type=Path, default=Path("/tmp/engine-agreement"))
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.run is None:
        args.run = train_runs(args.work / "runs", args.digits_epochs, args.b16_epochs)
    sys.path.insert(0, str(ROOT / "src"))
    from vitkit.data.datasets import open_dataset

    labels = open_dataset(args.data, args.split).labels.tolist()
    results: dict[str, Any] = {}
    print("| model | precision (engine) | top-1 | change vs fp32 | top-1 agreement with fp32 |")
    print("|---|---|---|---|---|")
    for run in args.run:
        top1 = {prec: predictions(run, args.data, args.split, prec, args.work) for prec in PRECISIONS}
        ref = top1["fp32"][0]
        acc_ref = sum(a == b for a, b in zip(ref, labels, strict=True)) / len(labels)
        for prec, (preds, note) in top1.items():
            acc = sum(a == b for a, b in zip(preds, labels, strict=True)) / len(labels)
            agree = sum(a == b for a, b in zip(preds, ref, strict=True))
            results.setdefault(str(run), {})[prec] = {
                "top1": acc, "agreement": agree / len(ref), "agree": agree, "n": len(ref), "engine": note,
            }  # fmt: skip
            print(f"| {run.name} | {prec} ({note}) | {acc:.2%} | {100 * (acc - acc_ref):+.2f} pt | "
                  f"{agree / len(ref):.2%} ({agree}/{len(ref)}) |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
