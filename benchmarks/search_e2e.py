"""Feeds the table "Similarity search" of BENCHMARKS.md, its end-to-end line (``python benchmarks/run_all.py
search-e2e``).

Issue 44's goal: ``vitkit index`` over 10,000 JPEGs then ``vitkit search`` with 100 query images costs, per image,
within 1.1x of ``vitkit embed`` alone on the same images (the index costs little next to the model). Four whole
commands, each a fresh process, side by side in one run, same checkpoint, precision, batch size and workers:

    vitkit embed  CKPT photos/  --out photos.npy      vitkit embed  CKPT queries/ --out queries.npy
    vitkit index  photos/ -c CKPT --out photos.index  vitkit search photos.index queries/ --out hits.jsonl

and the ratio (index + search) / (embed photos + embed queries) of their wall times.

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/search_e2e.py \
        [--images 10000] [--queries 100] [--model Ti/16] [--work /tmp/vitkit-search-e2e] [--json out.json]

The images: random crops (40-100% of a side), resizes to 224-320 px, horizontal flips and JPEG qualities 75-95 of
scikit-learn's two sample photos (seeded; made once in ``--work`` and reused). The checkpoint: a random-init
``--model`` at 224 px written with vitkit's own API (``create_model`` + ``save_checkpoint``; no trained photo
model is on this machine, and the cost measured is the model's forward pass, which its weights do not change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_photos(folder: Path, count: int, seed: int) -> list[Path]:
    """``count`` JPEGs under ``folder`` (made once; an existing complete set is reused)."""
    from PIL import Image, ImageOps
    from sklearn.datasets import load_sample_image

    paths = [folder / f"{i // 1000:02d}" / f"img{i:05d}.jpg" for i in range(count)]
    if all(p.exists() for p in paths):
        return paths
    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(load_sample_image(n)) for n in ("china.jpg", "flower.jpg")]
    for p in paths:
        img = photos[int(rng.integers(2))]
        w, h = img.size
        f = rng.uniform(0.4, 1.0)
        cw, ch = int(w * f), int(h * f)
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        side = int(rng.integers(224, 321))
        out = img.crop((x, y, x + cw, y + ch)).resize((side, int(side * ch / cw)), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            out = ImageOps.mirror(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        out.save(p, quality=int(rng.integers(75, 96)))
    return paths


def make_checkpoint(path: Path, model: str) -> Path:
    import torch

    from vitkit.checkpoints import save_checkpoint
    from vitkit.models.variants import create_model

    if not path.exists():
        torch.manual_seed(0)
        save_checkpoint(create_model(model, image_size=224, num_classes=0), path, "vitkit")
    return path


def timed(cmd: list[str], rates: dict[str, float], name: str) -> float:
    """The wall time of ``cmd`` (a fresh process); its embedding pass's final rate (tqdm's img/s) into ``rates``
    and its engine note echoed, so that a run shows whether the two commands embedded alike."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ " + " ".join(cmd[2:]), file=sys.stderr)
    t = time.perf_counter()
    run = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t
    if run.returncode:
        sys.exit(f"{' '.join(cmd[2:])}: exit {run.returncode}\n{run.stderr[-4000:]}")
    found = re.findall(r"([0-9.]+)img/s", run.stderr)
    if found:
        rates[name] = float(found[-1])
    for line in run.stderr.splitlines():
        if line.startswith("note: engine:"):
            print(line, file=sys.stderr)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--model", default="Ti/16")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vitkit-search-e2e"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = args.work / f"n{args.images}"
    t = time.perf_counter()
    make_photos(work / "photos", args.images, seed=0)
    make_photos(work / "queries", args.queries, seed=1)
    ckpt = make_checkpoint(args.work / (args.model.replace("/", "") + ".vitkit"), args.model)
    print(f"images and checkpoint ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    runs = work / "runs"
    if runs.exists():
        import shutil

        shutil.rmtree(runs)
    runs.mkdir()
    vk = [sys.executable, "-m", "vitkit"]
    same = ["--precision", args.precision, "--batch-size", str(args.batch_size)]
    c = str(ckpt)
    photos, queries = str(work / "photos"), str(work / "queries")
    commands = {
        "embed_photos": [*vk, "embed", c, photos, "--out", str(runs / "photos.npy"), *same],
        "embed_queries": [*vk, "embed", c, queries, "--out", str(runs / "queries.npy"), *same],
        "index": [*vk, "index", photos, "-c", c, "--out", str(runs / "photos.index"), *same],
        "search": [*vk, "search", str(runs / "photos.index"), queries, "--out", str(runs / "hits.jsonl")],
    }
    rates: dict[str, float] = {}
    times = {name: timed(cmd, rates, name) for name, cmd in commands.items()}
    hits = (runs / "hits.jsonl").read_text().splitlines()
    assert len(hits) == args.queries, f"{len(hits)} result rows for {args.queries} queries"
    embed = times["embed_photos"] + times["embed_queries"]
    total = times["index"] + times["search"]
    n = args.images + args.queries
    record: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "model": args.model, "image_size": 224,
        "precision": args.precision, "batch_size": args.batch_size, "images": args.images, "queries": args.queries,
        "seconds": times, "img_per_s": rates, "embed_ms_per_image": 1e3 * embed / n,
        "index_search_ms_per_image": 1e3 * total / n,
        "ratio": total / embed,
    }  # fmt: skip
    print(json.dumps(record, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
