"""A run's logs: ``config.json``, ``metrics.csv`` (per epoch), ``steps.csv`` (every few steps), ``selection.csv``
(the evaluations the weights are selected by), TensorBoard events in ``tb/`` (when tensorboard is installed) and
``curves.png``. Written by process 0 only (the callers check), never through a link: whole files by
:func:`~vitkit.fileio.write_file_atomic`, the CSV logs appended through :func:`~vitkit.fileio.open_append`."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from vitkit.fileio import open_append, open_regular, refuse_link, write_file_atomic, write_text_atomic

CSV_LOGS = ("steps.csv", "metrics.csv", "selection.csv")


def start(run_dir: Path, config: dict[str, Any], step: int, resumed: bool) -> tuple[list[dict[str, Any]], Any]:
    """Write ``config.json`` and start the CSV logs: a resumed run's cut back to ``step`` (what the interrupted
    run logged after its last checkpoint goes), a new run's removed. Returns the epoch rows kept and a
    TensorBoard writer (None without tensorboard)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_link(run_dir / "tb")  # TensorBoard writes its event files in there
    write_config(run_dir, config)
    for name in CSV_LOGS:
        if resumed:
            truncate_csv(run_dir / name, step)
        else:
            (run_dir / name).unlink(missing_ok=True)
    rows = read_csv(run_dir / "metrics.csv") if resumed else []
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return rows, None
    return rows, SummaryWriter(str(run_dir / "tb"), purge_step=step if resumed else None)


def write_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """A run's ``config.json`` (what resume and ``vitkit train --resume`` read back), the one writer of it:
    written and renamed into place by :func:`~vitkit.fileio.write_text_atomic` (a crash leaves the old file)."""
    return write_text_atomic(run_dir / "config.json", json.dumps(config, indent=2) + "\n")


def log_step(run_dir: Path, tb: Any, rec: dict[str, float], images_per_s: float) -> None:
    """One line of ``steps.csv`` (and the TensorBoard scalars ``train/*``)."""
    row = {"step": int(rec["step"]), "loss": rec["loss"], "lr": rec["lr"], "grad_norm": rec["grad_norm"]}
    append_csv(run_dir / "steps.csv", {**row, "images_per_s": round(images_per_s, 1)})
    if tb is not None:
        for k in ("loss", "lr", "grad_norm"):
            tb.add_scalar(f"train/{k}", rec[k], int(rec["step"]))
        tb.add_scalar("train/images_per_s", images_per_s, int(rec["step"]))


def log_epoch(run_dir: Path, tb: Any, row: dict[str, Any]) -> None:
    """One line of ``metrics.csv`` (and the TensorBoard scalars ``epoch/*`` of its numbers)."""
    append_csv(run_dir / "metrics.csv", row)
    if tb is not None:
        for k, v in row.items():
            if k not in ("epoch", "step") and isinstance(v, (int, float)) and v == v:
                tb.add_scalar(f"epoch/{k}", v, int(row["step"]))


def _csv_text(rows: list[dict[str, Any]], header: bool) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    if header:
        w.writeheader()
    w.writerows(rows)
    return buf.getvalue().encode("utf-8")


def append_csv(path: Path, row: dict[str, Any]) -> None:
    """One row appended to a CSV log (its header first when the file is new); never through a link."""
    with open_append(path) as f:
        f.write(_csv_text([row], header=f.seek(0, 2) == 0))


def read_csv(path: Path) -> list[dict[str, Any]]:
    """A CSV log's rows (numbers as numbers); none when it is missing. A link there is refused, not read."""
    refuse_link(path)
    if not path.exists():
        return []
    with open_regular(path, "", write=False) as f:
        text = f.read().decode("utf-8")
    return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(io.StringIO(text, newline=""))]


def _num(v: str) -> Any:
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def truncate_csv(path: Path, step: int) -> None:
    rows = [r for r in read_csv(path) if int(r["step"]) <= step]
    if rows:
        write_file_atomic(path, lambda tmp: tmp.write_bytes(_csv_text(rows, header=True)))
    else:
        path.unlink(missing_ok=True)


def plot_curves(metrics_csv: Path, out_png: Path) -> None:
    """Train/validation loss and validation top-1 per epoch, as a PNG (matplotlib, Agg backend)."""
    rows = read_csv(metrics_csv)
    if not rows:
        return
    from matplotlib.figure import Figure

    ep = [float(r["epoch"]) for r in rows]
    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(ep, [float(r["train_loss"]) for r in rows], label="train loss")
    ax1.plot(ep, [float(r["val_loss"]) for r in rows], label="validation loss")
    ax1.set(xlabel="epoch", ylabel="loss")
    ax1.legend()
    ax2.plot(ep, [100 * float(r["val_top1"]) for r in rows], color="C2")
    ax2.set(xlabel="epoch", ylabel="validation top-1 (%)")
    fig.tight_layout()
    write_file_atomic(out_png, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))  # a link there is refused
