"""Feeds the table "Batch inference: `vitkit eval` and `vitkit predict` end to end" of BENCHMARKS.md
(``python benchmarks/run_all.py batch_inference``).

An ImageFolder of photo-sized JPEGs (``--images``, default 2,000: crops of about 500 x 375 of scikit-learn's two
sample photos, shifted, scaled and mirrored at random, 10 class folders) and random-weight checkpoints in
vitkit's format (B/16 and S/16, 10 classes: the speed does not depend on the weights). For each model, each
step runs as its own process, timed from process start to exit:

- ``bench``: ``vitkit bench`` at the same batch and precision, the fast path's offline img/s (``vitkit-fast``);
- ``eval`` / ``predict``: ``vitkit eval`` / ``vitkit predict --out x.jsonl`` with the new defaults (``--precision
  auto``, decoding workers by default), images per second of wall time;
- ``eval-old`` / ``predict-old``: the same with ``--precision fp32 --workers 0`` (the fp32 model itself, decoding
  in the main process: the defaults before issue 23);
- ``memory``: ``vitkit predict`` over ``--memory-images`` (default 20,000; hard links to the photos, decoded
  like any other file) with the peak proportional set size (PSS) of the process and its decoding workers,
  sampled every second (only in this step: reading /proc/PID/smaps_rollup takes the process's memory-map lock),
  against the checkpoint's size.

The memory step runs for ``--memory-model`` only (default S/16 in int8, the fastest: the bound is about the
number of images, not the model). Results accumulate in ``WORK/results.json`` (one entry per model and step,
replaced when run again), so the steps can run in pieces of a few minutes each on a shared machine, e.g.::

    flock /tmp/vitkit-cpu.lock python benchmarks/batch_inference.py --work /tmp/bi --models S/16 \
        --steps bench eval predict
    python benchmarks/batch_inference.py --work /tmp/bi --report

On a GPU (``--device cuda``; bench, eval and predict run there) with ``--links N`` the eval/predict folder holds N
files, hard links to the photos in turn (the issue's 8,192 over 2,048 photos); ``--workers W`` sets the decoding
processes of eval and predict (default: theirs)::

    python benchmarks/batch_inference.py --work /tmp/bi --device cuda --images 2048 --links 8192 \
        --batch-size 256 --precision bf16 --models B/16 S/16 --steps bench eval predict --report

``--json FILE`` also writes them, with the table, to FILE (what ``run_all.py`` keeps); without ``--work`` the
photos, checkpoints and outputs go to a temporary folder removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SRC = [ROOT / "src"]  # the vitkit measured: this checkout's, or --src (an older tree, measured in the same run)
STEPS = ("bench", "eval", "predict", "eval-old", "predict-old", "memory")
CLASSES = [f"c{i}" for i in range(10)]


def make_photos(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` JPEGs of about 500 x 375 in ``folder/test/<class>/``: random crops of the two sample photos
    (each first scaled by 0.9-1.0), mirrored half of the time, saved at quality 85-92."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    photos = [Image.fromarray(load_sample_image(n)) for n in ("china.jpg", "flower.jpg")]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        img = photos[i % 2]
        s = rng.uniform(0.9, 1.0)
        img = img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BILINEAR)
        w, h = int(rng.integers(480, 521)), int(rng.integers(360, 384))
        x, y = int(rng.integers(0, img.width - w + 1)), int(rng.integers(0, img.height - h + 1))
        crop = img.crop((x, y, x + w, y + h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        path = folder / "test" / CLASSES[i % len(CLASSES)] / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        crop.save(path, quality=int(rng.integers(85, 93)))
        out.append(path)
    return out


def link_copies(photos: list[Path], folder: Path, count: int) -> None:
    """``count`` files in ``folder/<class>/``: hard links to ``photos`` in turn (decoded like distinct files)."""
    for i in range(count):
        path = folder / CLASSES[i % len(CLASSES)] / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.link(photos[i % len(photos)], path)


def make_checkpoint(name: str, path: Path) -> Path:
    """A random-weight ``name`` (10 classes, 224 px) in vitkit's format."""
    import vitkit

    if not path.exists():
        model = vitkit.create_model(name, num_classes=len(CLASSES)).eval()
        vitkit.save_pretrained(model, path, class_names=CLASSES)
    return path


def vitkit_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "vitkit", *argv]


def env() -> dict[str, str]:
    """The commands' environment: the measured vitkit first on the path (then whatever PYTHONPATH held)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC[0]), os.environ.get("PYTHONPATH", "")])}


def timed(cmd: list[str], sample_memory: bool = False) -> dict[str, Any]:
    """Run ``cmd``; its wall time from start to exit (and, with ``sample_memory``, the peak PSS of it and its
    children, every second). Raises on failure with its stderr."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=err)
        peak, main_peak = 0, 0
        while proc.poll() is None:
            if sample_memory:
                tree = [proc.pid, *children(proc.pid)]
                sizes = [pss(p) for p in tree]
                peak, main_peak = max(peak, sum(sizes)), max(main_peak, sizes[0])
            time.sleep(1.0 if sample_memory else 0.05)
        seconds = time.perf_counter() - start
        err.seek(0)
        text = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    notes = [ln for ln in text.splitlines() if ln.startswith("note: engine")]
    out: dict[str, Any] = {"seconds": seconds, "command": " ".join(cmd[2:]), "engine": notes[0] if notes else None}
    if sample_memory:
        out.update(peak_pss_mib=peak / 2**20, peak_pss_main_mib=main_peak / 2**20)
    return out


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes (shared pages split among their users), 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name", platform.processor())
    return f"{name}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, {os.cpu_count()} cores"


def auto_precision() -> str:
    """What ``--precision auto`` picks on this machine (the engine's own rule, a GEMM timed now)."""
    from vitkit.inference.policy import resolve_precision

    return resolve_precision("auto")


def run_step(step: str, model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    ckpt = make_checkpoint(model, work / f"ckpt-{model.replace('/', '')}")
    data = work / "photos" if not args.links else work / f"links-{args.links}"
    n = len(list((data / "test").rglob("*.jpg")))
    b, dev = str(args.batch_size), ["--device", args.device]
    workers = ["--workers", str(args.workers)] if args.workers is not None else []
    if step == "bench":
        precision = args.precision or auto_precision()
        out = work / f"bench-{model.replace('/', '')}.json"
        cmd = vitkit_cmd("bench", str(ckpt), "--batch-size", b, "--precision", precision, "--no-latency", "--repeats",
                         str(args.repeats), "--json", str(out), "--overwrite", *dev)  # fmt: skip
        res = timed(cmd)
        doc = json.loads(out.read_text())
        fast = next(r for r in doc["results"] if r["impl"] == "vitkit-fast")
        eager = next(r for r in doc["results"] if r["impl"] == "vitkit")
        res.update(precision=precision, img_per_s=fast["img_per_s"], eager_img_per_s=eager["img_per_s"],
                   cpu_util=fast["timing"]["cpu_util"])  # fmt: skip
        return res
    old = ["--precision", "fp32", "--workers", "0"] if step.endswith("-old") else []
    if args.precision and not old:
        old = ["--precision", args.precision]
    if step.startswith("eval"):
        cmd = vitkit_cmd("eval", str(ckpt), "--data", str(data), "--batch-size", b, *dev,
                         "--out", str(work / f"eval-{step}"), *workers, *old)  # fmt: skip
        res = timed(cmd)
    elif step.startswith("predict"):
        cmd = vitkit_cmd("predict", "-c", str(ckpt), str(data / "test"), "--batch-size", b, *dev,
                         "--out", str(work / f"{step}.jsonl"), "--overwrite", *workers, *old)  # fmt: skip
        res = timed(cmd)  # no memory sampling here: reading /proc/PID/smaps_rollup takes the process's mm lock
    else:  # memory
        many = work / f"many-{args.memory_images}"
        photos = sorted((data / "test").rglob("*.jpg"))
        link_copies(photos, many, args.memory_images)
        n = args.memory_images
        precision = args.memory_precision
        cmd = vitkit_cmd("predict", "-c", str(ckpt), str(many), "--batch-size", b, "--device", "cpu",
                         "--precision", precision, "--out", str(work / "memory.jsonl"), "--overwrite")  # fmt: skip
        res = timed(cmd, sample_memory=True)
        res["checkpoint_mib"] = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
    res.update(images=n, img_per_s=n / res["seconds"])
    return res


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _cell(steps: dict[str, Any], step: str, ref: float) -> str:
    if step not in steps:
        return "-"
    v = steps[step]["img_per_s"]
    return f"{v:.2f} img/s ({v / ref:.2f}x)"


def report(doc: dict[str, Any]) -> str:
    """The BENCHMARKS.md table: per model, end-to-end img/s of each step and its ratio to the offline fast path."""
    lines = [
        f"CPU: {doc.get('cpu', '?')}; device {doc.get('device', 'cpu')}; torch threads {doc.get('threads', '?')}; "
        f"batch {doc.get('batch_size', '?')}",
        "",
        "| model | offline fast path (`vitkit bench`) | `eval`, new defaults | `predict`, new defaults | `eval`, "
        "`--precision fp32 --workers 0` | `predict`, same | new / old |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, steps in doc.items():
        if not isinstance(steps, dict) or "bench" not in steps:
            continue
        ref = steps["bench"]["img_per_s"]
        speedup = [
            f"{steps[new]['img_per_s'] / steps[new + '-old']['img_per_s']:.2f}x"
            for new in ("eval", "predict")
            if new in steps and new + "-old" in steps
        ]
        lines.append(
            f"| {model} | {ref:.2f} img/s [{steps['bench']['precision']}] | {_cell(steps, 'eval', ref)} | "
            f"{_cell(steps, 'predict', ref)} | {_cell(steps, 'eval-old', ref)} | {_cell(steps, 'predict-old', ref)} | "
            f"{' / '.join(speedup) or '-'} |"
        )
    lines += ["", "| `vitkit predict` | images | peak PSS, process + workers | main process | checkpoint | img/s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for model, steps in doc.items():
        for step in ("memory",):
            m = steps.get(step) if isinstance(steps, dict) else None
            if m and "peak_pss_mib" in m:
                how = m["engine"].split("engine: ", 1)[-1] if m.get("engine") else "?"
                lines.append(
                    f"| {model}, {how} | {m['images']:,} | {m['peak_pss_mib']:.0f} MiB | {m['peak_pss_main_mib']:.0f} "
                    f"MiB | {m['checkpoint_mib']:.0f} MiB | {m['img_per_s']:.2f} |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work",
        type=Path,
        help="folder for the photos, checkpoints and outputs, kept (default: a temporary folder, removed at the end)",
    )
    p.add_argument("--images", type=int, default=2000, help="photos in the ImageFolder (default 2000)")
    p.add_argument("--links", type=int, default=0, help="eval/predict over this many files: hard links to the photos")
    p.add_argument("--device", default="cpu", help="where bench, eval and predict run (default cpu)")
    p.add_argument("--src", type=Path, help="the vitkit source tree to measure (default: this checkout's src/)")
    p.add_argument("--label", default="", help="appended to the results' keys (e.g. 'before': two trees, one file)")
    p.add_argument("--workers", type=int, default=None, help="eval/predict's decoding processes (default: theirs)")
    p.add_argument("--memory-images", type=int, default=20000, help="images of the memory step (default 20000)")
    p.add_argument("--memory-precision", default="int8", help="precision of the memory step (default int8: fastest)")
    p.add_argument("--memory-model", default="S/16", help="the model of the memory step (default S/16)")
    p.add_argument("--models", nargs="+", default=["S/16", "B/16"])
    p.add_argument("--steps", nargs="+", choices=STEPS, default=[])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--precision",
        help="precision of bench and the new-default runs (default: what auto picks); results are kept "
        "apart, under 'MODEL --precision P'",
    )
    p.add_argument("--repeats", type=int, default=5, help="vitkit bench's timed calls")
    p.add_argument("--report", action="store_true", help="print the BENCHMARKS.md table of what --work holds")
    p.add_argument("--json", type=Path, help="also write the results and the table to this file")
    args = p.parse_args()
    if args.src is not None:
        SRC[0] = args.src.resolve()
    sys.path.insert(0, str(SRC[0]))  # the measured vitkit, as the commands it runs (env())
    if args.work is None:
        with tempfile.TemporaryDirectory(prefix="vitkit-batch-") as tmp:
            args.work = Path(tmp)
            run(args)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        run(args)


def run(args: argparse.Namespace) -> None:
    results = args.work / "results.json"
    if not (args.work / "photos" / "test").is_dir():
        make_photos(args.work / "photos", args.images)
    if args.links:
        link_copies(sorted((args.work / "photos" / "test").rglob("*.jpg")), args.work / f"links-{args.links}" / "test",
                    args.links)  # fmt: skip
    for model in args.models:
        for step in args.steps:
            if step == "memory" and model != args.memory_model:
                continue
            res = run_step(step, model, args.work, args)
            doc = load(results)
            key = f"{model} --precision {args.precision}" if args.precision else model
            key += f" {args.label}" if args.label else ""
            doc.setdefault(key, {})[step] = res
            import torch

            gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
            doc.update(cpu=cpu_name(), threads=torch.get_num_threads(), batch_size=args.batch_size,
                       date=time.strftime("%Y-%m-%d"), device=gpu or "cpu")  # fmt: skip
            results.write_text(json.dumps(doc, indent=1))
            print(f"{model} {step}: {res['img_per_s']:.2f} img/s ({res['seconds']:.1f} s) {res.get('engine') or ''}",
                  flush=True)  # fmt: skip
    if args.report:
        print(report(load(results)))
    if args.json:
        doc = load(results)
        args.json.write_text(json.dumps({**doc, "table": report(doc)}, indent=1))


if __name__ == "__main__":
    main()
