"""A run's logs: ``metrics.csv`` (per epoch), ``steps.csv`` (every few steps) and ``curves.png``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def append_csv(path: Path, row: dict[str, Any]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)


def read_csv(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _num(v: str) -> Any:
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def truncate_csv(path: Path, step: int) -> None:
    rows = [r for r in read_csv(path) if int(r["step"]) <= step]
    path.unlink(missing_ok=True)
    for r in rows:
        append_csv(path, r)


def plot_curves(metrics_csv: Path, out_png: Path) -> None:
    """Train/validation loss and validation top-1 per epoch, as a PNG (matplotlib, Agg backend)."""
    rows = read_csv(metrics_csv)
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [float(r["epoch"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(ep, [float(r["train_loss"]) for r in rows], label="train loss")
    ax1.plot(ep, [float(r["val_loss"]) for r in rows], label="validation loss")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax2.plot(ep, [100 * float(r["val_top1"]) for r in rows], color="C2")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation top-1 (%)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
