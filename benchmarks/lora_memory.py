"""Feeds the table "Adaptation: LoRA memory and step time" of BENCHMARKS.md (``python benchmarks/run_all.py
adaptation_memory``) and the "Memory" section of docs/adaptation.md: one training step of LoRA against full
fine-tuning, S/16 and B/16 at batch 32 and 224 px, and issue 34's goals for it (LoRA's allocator peak <= 0.75x
full's, its peak RSS <= 0.8x, its step time <= full's).

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/lora_memory.py
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/lora_memory.py --variants Ti/16 --batch 4 --steps 3

A randomly initialised checkpoint of each variant is fine-tuned to 10 classes of random 224 px images as
``vitkit finetune`` trains on a CPU (the ``finetune-small`` recipe's SGD, bf16 autocast, the CPU training
kernels where this machine has them, no validation split): ``full`` trains every weight, ``lora`` rank-8
adapters on qkv, proj, fc1 and fc2 and the head. Each method of each variant runs in two fresh processes:

- ``time``: ``--steps`` steps; the median step time after the first, and the process's peak resident memory
  (``getrusage``'s maximum RSS) after the last step, before anything is saved;
- ``alloc``: two steps under ``torch.profiler``'s memory recording, started before the trainer is built: the
  peak of the bytes held in PyTorch's CPU allocator during the second step (every allocation and free since the
  start, summed in time order; the profiler's own records are why this is a process of its own), and the bytes
  that step's forward pass kept for the backward pass (``torch.autograd.graph.saved_tensors_hooks``, each storage
  once, parameters not counted).

The results go to benchmarks/results/adaptation/lora_memory.json, or to ``--json FILE`` (as ``run_all.py``
runs it); the table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from adaptation import cpu_name, random_inputs  # this folder's (the scripts run from it)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "adaptation"
MARK = "lora_memory::step_end"  # a profiler event after every step: the windows of the allocator's timeline
GOALS = {"alloc_peak_mb": 0.75, "peak_rss_mb": 0.8, "step_s": 1.0}  # issue 34: lora / full at most


def inputs(work: Path, variant: str, batch: int) -> tuple[Path, Path]:
    """A random-init ``variant`` checkpoint and 2 x ``batch`` random 224 px images of 10 classes (made once)."""
    return random_inputs(work, variant, 2 * batch)


class _Stop(Exception):
    pass


class SavedBytes:
    """Bytes the autograd graph keeps for the backward pass while active: each storage once, parameters not."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen, self.bytes = params, set[int](), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t


def peak_in_window(prof: Any, window: int) -> tuple[float, float]:
    """(peak, held at its start) of the allocator's bytes in the window after the ``window``-th step mark."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    marks = [e.start_ns() for e in events if e.name() == MARK]
    lo, hi = marks[window - 1], marks[window]
    held = start = peak = 0
    for e in events:
        if e.name() != "[memory]" or e.start_ns() > hi:
            continue
        held += e.nbytes()
        if e.start_ns() < lo:
            start = peak = held
        else:
            peak = max(peak, held)
    return peak / 2**20, start / 2**20


def run_one(ckpt: str, data: str, method: str, steps: int, batch: int, work: Path, mode: str) -> dict[str, Any]:
    """One method in this (fresh) process: ``time`` (step times, peak RSS) or ``alloc`` (allocator, saved bytes)."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import ProfilerActivity, profile, record_function

    from vitkit.configs import finetune_config
    from vitkit.train import Trainer

    cfg = finetune_config(ckpt, data, "finetune-small", (224, 224), method=method).override(
        **{"data.batch_size": batch, "data.workers": 0, "data.val_split": None, "steps": steps, "precision": "bf16"},
        **{"checkpoint_every_steps": None, "optim.warmup_steps": 0, "adapt.select": False},
    )
    steps = 2 if mode == "alloc" else steps
    stamps: list[float] = []
    result: dict[str, Any] = {}

    def on_step(trainer: Trainer, rec: dict[str, float]) -> None:
        stamps.append(time.perf_counter())
        with record_function(MARK):
            pass
        if trainer.step == steps:
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            raise _Stop

    out = work / f"mem-{Path(ckpt).name}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if mode == "alloc" else None
    with profiler or contextlib.nullcontext():
        trainer = Trainer(cfg, out, progress=False)
        net = trainer.net
        saved = SavedBytes({p.untyped_storage().data_ptr() for p in net.parameters()})
        forward = trainer.forward

        def counted(x: torch.Tensor) -> torch.Tensor:  # the last step's forward pass
            if trainer.step != steps - 1:
                return forward(x)
            with saved_tensors_hooks(saved.pack, lambda t: t):
                return forward(x)

        trainer.forward = counted
        result["setup_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        stamps.append(time.perf_counter())
        with contextlib.suppress(_Stop):
            trainer.fit(on_step=on_step)
    trainer.close(clean=False)
    shutil.rmtree(out, ignore_errors=True)
    result["trainable"] = sum(p.numel() for p in net.parameters() if p.requires_grad)
    result["parameters"] = sum(p.numel() for p in net.parameters())
    if profiler is not None:
        result["alloc_peak_mb"], result["alloc_start_mb"] = peak_in_window(profiler, steps - 1)
        result["saved_mb"] = saved.bytes / 2**20
        return {k: v for k, v in result.items() if not k.endswith("rss_mb")}  # the profiler's records are in it
    times = [b - a for a, b in itertools.pairwise(stamps)]
    return {**result, "step_s": statistics.median(times[1:]), "step_times": times}


def measure(work: Path, variant: str, steps: int, batch: int) -> dict[str, Any]:
    """Both methods of one variant, each measurement in a fresh process; their ratios lora / full."""
    ckpt, data = inputs(work, variant, batch)
    rows: dict[str, dict[str, Any]] = {}
    for method in ("full", "lora"):
        rows[method] = {}
        for mode in ("time", "alloc"):
            cmd = [sys.executable, __file__, "--one", str(ckpt), str(data), method, str(steps), str(batch), mode]
            cmd += ["--work", str(work)]
            printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows[method].update(json.loads(printed.strip().splitlines()[-1]))
        print(variant, method, {k: v for k, v in rows[method].items() if k != "step_times"}, flush=True)
    ratios = {k: rows["lora"][k] / rows["full"][k] for k in ("alloc_peak_mb", "saved_mb", "peak_rss_mb", "step_s")}
    met = {k: ratios[k] <= limit for k, limit in GOALS.items()}
    return {"variant": variant, "batch": batch, "methods": rows, "lora_over_full": ratios, "met": met}


def table(docs: list[dict[str, Any]]) -> str:
    lines = [
        "| model, batch | method | trained parameters | allocator peak | kept for backward | peak RSS | step |",
        "|---|---|---|---|---|---|---|",
    ]
    for doc in docs:
        model = f"{doc['variant']}, {doc['batch']}"
        for method, r in doc["methods"].items():
            lines.append(
                f"| {model} | {method} | {r['trainable'] / 1e6:.2f} M of {r['parameters'] / 1e6:.1f} M | "
                f"{r['alloc_peak_mb']:.0f} MiB | {r['saved_mb']:.0f} MiB | {r['peak_rss_mb']:.0f} MiB | "
                f"{r['step_s']:.2f} s |"
            )
        q, met = doc["lora_over_full"], doc["met"]
        mark = {k: "" if met.get(k, True) else " (goal not met)" for k in q}
        lines.append(
            f"| {model} | **lora / full** | | **{q['alloc_peak_mb']:.2f}x**{mark['alloc_peak_mb']} | "
            f"{q['saved_mb']:.2f}x | **{q['peak_rss_mb']:.2f}x**{mark['peak_rss_mb']} | "
            f"**{q['step_s']:.2f}x**{mark['step_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["S/16", "B/16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="steps of the timed process (the first is not timed)")
    p.add_argument("--work", type=Path, default=Path("/tmp/vitkit-lora-memory"), help="checkpoints, data, runs")
    p.add_argument("--json", type=Path, help="write the results here (not to benchmarks/results/adaptation/)")
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # CKPT DATA METHOD STEPS BATCH MODE: one process
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.one:
        ckpt, data, method, steps, batch, mode = a.one
        print(json.dumps(run_one(ckpt, data, method, int(steps), int(batch), a.work, mode)))
        return
    docs = [measure(a.work, v, a.steps, a.batch) for v in a.variants]
    doc = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": a.steps}
    out = a.json or RESULTS / "lora_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**doc, "variants": docs}, indent=1) + "\n")
    print(f"wrote {out}\n\n{table(docs)}")


if __name__ == "__main__":
    main()
