"""``vitkit finetune --sweep lr``: the learning rate chosen on held-out data, as the paper chooses its
fine-tuning learning rate (a sweep over {0.001, 0.003, 0.01, 0.03} for SGD, on a validation split).

Every learning rate of :func:`lr_grid` trains the same config (the same seed, so the same held-out split and the
same data order) into ``OUT/sweep/lr-<lr>/``, and each run keeps its best weights on the held-out split
(``adapt.select``). The learning rate whose kept weights score the best top-1 there wins (a tie: the lower one).
Its run folder's entries are renamed into ``OUT``, which is then a normal run: no re-training on the held-out
images. The other runs' entries (only the names a run writes) are removed. ``OUT/sweep.csv`` lists every
learning rate, and ``model/``'s provenance ``sweep`` the grid, each one's held-out top-1 and the one chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitkit import fileio
from vitkit.configs import TrainConfig
from vitkit.distributed import launched_by_torchrun
from vitkit.errors import ConfigError
from vitkit.train import logs
from vitkit.train.run import TrainResult, check_run_dir, remove_run_entries
from vitkit.train.trainer import NonFiniteLossError, train

LR_FACTORS = (0.1, 1 / 3, 1.0, 3.0)  # the grid around the run's lr: the paper's 30x span in half-decades
SWEEP_ENTRIES = ("sweep", "sweep.csv")  # what a sweep writes in OUT besides the winner's run


@dataclass
class SweepResult:
    """What :func:`sweep_lr` returns: the kept run's result (its ``run_dir`` the output folder) and one row per
    learning rate (``lr``, ``val_top1`` of its kept weights, ``selected_step``, ``seconds``; a run that diverged
    has ``val_top1`` None)."""

    result: TrainResult
    lr: float
    rows: list[dict[str, Any]]

    def summary(self) -> str:
        """The table of the sweep, then the kept run's summary."""
        lines = [f"{'lr':>10} {'val top-1':>10} {'kept step':>10} {'seconds':>8}"]
        for r in self.rows:
            top1 = "diverged" if r["val_top1"] is None else f"{100 * r['val_top1']:.2f}%"
            mark = "  <- kept" if r["lr"] == self.lr else ""
            lines.append(f"{r['lr']:>10g} {top1:>10} {r['selected_step'] or '-':>10} {r['seconds']:>8.1f}{mark}")
        lines.append(f"lr {self.lr:g} chosen on held-out data; its run is kept as it is (no re-training)")
        return "\n".join([*lines, self.result.summary()])


def lr_grid(base: float) -> list[float]:
    """The learning rates a sweep tries: ``base`` x 0.1, 1/3, 1, 3, each but ``base`` rounded to one significant
    digit (0.03 -> 0.003, 0.01, 0.03, 0.09), ascending."""
    return sorted({base, *(float(f"{base * f:.1g}") for f in LR_FACTORS if f != 1.0)})


def check_sweep_out(path: Path) -> None:
    """Refuse an output folder a sweep cannot use (what :func:`check_run_dir` refuses, and a ``sweep`` or
    ``sweep.csv`` already there), before any work."""
    check_run_dir(path)
    for name in SWEEP_ENTRIES:
        if (path / name).exists() or (path / name).is_symlink():
            raise ConfigError(f"{path}: holds {name!r}, which a sweep would overwrite; choose another --out")


def check_sweep(cfg: TrainConfig) -> None:
    """Refuse a config a sweep cannot run, before any work."""
    if cfg.adapt.method == "linear" or not cfg.adapt.select:
        raise ConfigError(
            "a learning-rate sweep needs a method that trains (full, lp-ft, lora) and adapt.select (the held-out "
            "split it chooses on)"
        )
    if launched_by_torchrun():
        raise ConfigError("--sweep runs in one process; run it without torchrun")
    lr = cfg.optim.lr
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):  # NaN would name all four runs lr-nan
        raise ConfigError(f"optim.lr {lr!r}: a learning-rate sweep needs a positive, finite learning rate")


def _free_folder(base: Path) -> Path:
    """``base``, or the first of ``base-2``, ``base-3``... that a sweep can use (as a default run folder)."""
    check_run_dir(base, numbered=True)
    n = 1
    while True:
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            check_sweep_out(path)
            return path
        except ConfigError:
            n += 1


def sweep_lr(cfg: TrainConfig, out: str | os.PathLike[str] | None = None, *, progress: bool = True) -> SweepResult:
    """Train ``cfg`` once per learning rate of :func:`lr_grid` (``cfg.optim.lr``) and keep the run whose
    selected weights score the best top-1 on the held-out split, in ``out`` (default ``runs/<name>``, numbered
    when taken); see the module's docstring."""
    check_sweep(cfg)
    folder = _free_folder(Path("runs") / cfg.name) if out is None else Path(out)
    check_sweep_out(folder)
    (folder / "sweep").mkdir(parents=True)
    results: dict[float, TrainResult] = {}
    rows = [_run_one(cfg.override(**{"optim.lr": lr}), folder, results, progress) for lr in lr_grid(cfg.optim.lr)]
    if not results:
        raise ConfigError("every learning rate of the sweep diverged (a loss or gradient became NaN/inf)")
    best = max(results, key=lambda lr: (results[lr].best_top1 or 0.0, -lr))  # ties: the lower lr
    _keep(folder, best, [r["lr"] for r in rows])
    record = {"name": "lr", "chosen": best, "grid": [r["lr"] for r in rows]}
    record["val_top1"] = {f"{lr:g}": r.best_top1 for lr, r in results.items()}
    _record_in_model(folder / "model", record, str(folder))
    return SweepResult(dataclasses.replace(results[best], run_dir=folder), best, rows)


def _run_one(cfg: TrainConfig, folder: Path, results: dict[float, TrainResult], progress: bool) -> dict[str, Any]:
    """Train ``cfg`` into its folder of the sweep; its result goes into ``results`` (not when it diverged); its
    row of ``sweep.csv`` is appended and returned."""
    lr, t0 = cfg.optim.lr, time.perf_counter()
    try:
        results[lr] = got = train(cfg, _run_dir(folder, lr), progress=progress)
    except NonFiniteLossError as e:
        print(f"note: lr {lr:g} diverged: {e}", file=sys.stderr)
        row = {"lr": lr, "val_top1": None, "selected_step": None}
    else:
        if got.selected_step is None:
            raise ConfigError("nothing held out to choose the learning rate on (a class has a single training image)")
        row = {"lr": lr, "val_top1": got.best_top1, "selected_step": got.selected_step}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    logs.append_csv(folder / "sweep.csv", row)
    return row


def _keep(folder: Path, best: float, grid: list[float]) -> None:
    """The winner's run entries renamed into ``folder``; the other runs removed."""
    for lr in grid:
        if lr != best:
            _remove_run(_run_dir(folder, lr))
    won = _run_dir(folder, best)
    for entry in os.listdir(won):
        fileio.publish(won / entry, folder / entry)  # a link planted there is refused, never followed
    won.rmdir()
    with contextlib.suppress(OSError):  # left when a run folder held files vitkit did not write
        (folder / "sweep").rmdir()


def _run_dir(folder: Path, lr: float) -> Path:
    return folder / "sweep" / f"lr-{lr:g}"


def _remove_run(run: Path) -> None:
    """Remove what a run wrote (the names of RUN_ENTRIES) and its folder; anything else there is left, with a
    note. A run that diverged before its first checkpoint removed its own already."""
    if not run.is_dir():
        return
    remove_run_entries(run)
    try:
        run.rmdir()
    except OSError:
        print(f"note: {run}: left as it is (it holds files vitkit did not write)", file=sys.stderr)


def _record_in_model(model: Path, record: dict[str, Any], run: str) -> None:
    """Add ``sweep`` to the provenance in ``model/config.json`` (beside ``selected_step``), and the run's new
    folder."""
    path = model / "config.json"
    doc = json.loads(path.read_text())
    doc["provenance"] = {**doc.get("provenance", {}), "run": run, "sweep": record}
    fileio.write_file_atomic(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))
