"""Feeds the tables "Adaptation: every method's default, seeds 0-3" and "Adaptation: accuracy and wall time per method"
(``python benchmarks/run_all.py adaptation``) and "Adaptation: features through the fast path" (``python
benchmarks/run_all.py adaptation_features``) of BENCHMARKS.md: ``vitkit finetune --method linear|lp-ft|lora|full``
against ``vitkit fewshot``'s ridge probe, and the linear method's feature pass in fp32, bf16 and int8. LoRA's
training memory and step time: ``benchmarks/lora_memory.py``.

Everything is built on the machine (no downloads). The backbone is ``vitkit train``'s default recipe (the
digits ViT) trained on digits 0-4 only; the targets are

- ``digits``: digits 5-9, with 1, 5, 10 and 25 training images per class (the shot sets of ``vitkit
  fewshot``'s sampler, seed 0: nested) and the full training split; accuracy on the whole 5-9 test split;
- ``photos``: scikit-learn's two sample photos cut into 4 labelled regions (each photo's left and right
  half), 48x48 patches from the even horizontal bands of the photo to train on (60 per class) and from the
  odd bands to test on (30 per class; no pixel in both), 10 shots per class and the full split.

Every method fine-tunes with the ``finetune-small`` recipe (SGD, batch 64 or the whole set when smaller,
300 steps) at the backbone's 16 px, with the digits recipe's light augmentation (crop scale 0.7-1, no flip);
``ridge`` is ``vitkit fewshot``'s probe (closed-form least squares, l2 = 2^10) on the same features and
shots. Wall time is the in-process time of the whole job (model load, features with a cold cache, fit or
training, saving) after one warm-up of the process's imports, one run each, seed 0; fine-tuning runs
evaluate once, at the end (but save their resumable state at every epoch end, which on a few-shot set is
every step). ``linear (warm)``: a second linear run with another L2 strength (1e-2), its features from the
cache; ``linear +4 aug``: with ``--feature-epochs 4`` (four augmented feature passes; the clean features
from the cache).

Pieces, each a few minutes on 2 cores (results in benchmarks/results/adaptation/<piece>.json)::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py backbone
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py defaults --seeds 0,1,2,3
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py defaults --seeds 0,1,2,3 --sweep
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py digits --shots 1,5
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py digits --shots 10,25
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py digits --shots full
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py photos
    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/adaptation.py features B/16
    python benchmarks/adaptation.py table

Each piece writes benchmarks/results/adaptation/<piece>.json, or with ``--json FILE`` (as ``run_all.py`` runs
it) that file instead, so a ``--quick`` smoke run never replaces the measured pieces.

``features VARIANT``: the linear method's feature pass (cold cache) of a randomly initialised VARIANT at 224 px
over ``--images`` random images, fp32 against ``--feature-precision bf16`` and ``int8`` (the fast inference
path), alternating ``--rounds`` times: images per second of each, and their features' relative error.

``defaults``: ``vitkit finetune backbone --data upper.npz --method M --seed S`` for every method and ``--seeds``
(0-3), exactly as a user types it -- no recipe, so the schedule sized by the data -- each in a fresh process:
wall time from the process's start to its saved checkpoint, the test top-1 it prints (the 179 test images of
5-9; the weights were selected on a tenth of the training split), and the step it kept. ``--target photos``:
the same on the sample-photo regions (which no default was chosen on; their training patches overlap one another,
so a held-out slice of them is nearly seen data), ``--target gratings`` on synthetic gratings of independent images
(:func:`gratings_npz`: 4 orientations, 240 to train on, 400 to test on; nothing chosen on them either).
``--sweep``: lp-ft, lora and full with ``--sweep lr`` (four learning rates, each run's kept weights scored on the
held-out split), the rate each chose.
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "adaptation"
METHODS = ("linear", "lp-ft", "lora", "full")
PHOTO_BANDS = 8  # horizontal bands per photo: even ones to train on, odd ones to test on
PATCH = 48


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_id() -> dict[str, str]:
    """lscpu's family and model (the model name of a cloud Xeon says little)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        key, _, value = line.partition(":")
        if key.strip() in ("cpu family", "model") and key.strip() not in info:
            info[key.strip()] = value.strip()
    return {"cpu_family": info.get("cpu family", ""), "cpu_model": info.get("model", "")}


def save(piece: str, doc: dict[str, Any], out: Path | None = None) -> None:
    """The piece's results: ``out`` (``--json``) when given, else benchmarks/results/adaptation/<piece>.json."""
    doc = {"cpu": cpu_name(), **cpu_id(), "torch": torch.__version__, "threads": torch.get_num_threads(), **doc}
    if out is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{piece}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


# ---- data -------------------------------------------------------------------------------------------------


def digits_npz(path: Path, low: bool) -> Path:
    """vitkit's digits splits restricted to 0-4 (``low``) or 5-9, labels 0..4, named by their digit."""
    from vitkit.data.datasets import open_dataset

    first = 0 if low else 5
    arrays: dict[str, Any] = {"classes": np.asarray([str(first + i) for i in range(5)])}
    for split in ("train", "test"):
        ds = open_dataset("digits", split)
        keep = (ds.labels < 5) if low else (ds.labels >= 5)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = ds.images[keep], ds.labels[keep] - first
    np.savez(path, **arrays)
    return path


def shot_npz(full: Path, out: Path, shots: int) -> Path:
    """The ``shots`` per class of ``vitkit fewshot``'s sampler (seed 0) as the training split; test unchanged."""
    from vitkit.evaluate.fewshot import sample_episodes

    z = dict(np.load(full))
    episode = sample_episodes(z["train_labels"], len(z["classes"]), [shots], seeds=(0,))[0]
    z["train_images"], z["train_labels"] = z["train_images"][episode.train], z["train_labels"][episode.train]
    np.savez(out, **z)
    return out


def photos_npz(path: Path, train_per_class: int = 60, test_per_class: int = 30) -> Path:
    """scikit-learn's two sample photos cut into labelled patches: 4 classes (photo x left/right half),
    48x48 patches inside horizontal bands of the photo, the even bands to train on and the odd ones to test
    on (no pixel in both)."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    rng = np.random.default_rng(0)
    names: list[str] = []
    arrays: dict[str, list[Any]] = {k: [] for k in ("train_images", "train_labels", "test_images", "test_labels")}
    for photo, img in zip(("china", "flower"), photos.images, strict=True):
        H, W = img.shape[:2]
        band = H // PHOTO_BANDS
        for side, (x0, x1) in (("left", (0, W // 2)), ("right", (W // 2, W))):
            label = len(names)
            names.append(f"{photo} {side}")
            for split, first, n in (("train", 0, train_per_class), ("test", 1, test_per_class)):
                bands = range(first, PHOTO_BANDS, 2)
                for i in range(n):
                    b = bands[i % len(bands)]
                    y = int(rng.integers(b * band, (b + 1) * band - PATCH + 1))
                    x = int(rng.integers(x0, x1 - PATCH + 1))
                    arrays[f"{split}_images"].append(img[y : y + PATCH, x : x + PATCH])
                    arrays[f"{split}_labels"].append(label)
    np.savez(path, classes=np.asarray(names), **{k: np.asarray(v) for k, v in arrays.items()})
    return path


def gratings_npz(path: Path, train_per_class: int = 60, test_per_class: int = 100, size: int = 32) -> Path:
    """A synthetic set of independent images (seed 0), the third transfer: noisy sinusoidal gratings whose class
    is their orientation (0, 45, 90 or 135 degrees, each image's own drawn from a normal of 15 degrees around it,
    so neighbouring classes overlap a little), with a random period (6-12 px), phase, colour pair and pixel noise.
    No image shares anything with another but the recipe, so a held-out slice of train is a fair sample."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    arrays: dict[str, Any] = {}
    for split, n in (("train", train_per_class), ("test", test_per_class)):
        labels = np.repeat(np.arange(4), n)
        images = np.empty((len(labels), size, size, 3), dtype=np.uint8)
        for i, label in enumerate(labels):
            theta = np.deg2rad(45.0 * label + rng.normal(0.0, 15.0))
            period, phase = rng.uniform(6.0, 12.0), rng.uniform(0.0, 2 * np.pi)
            wave = np.sin(2 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period + phase)  # (H, W)
            low, high = rng.uniform(0.0, 1.0, (2, 3))  # the two colours it runs between
            img = low + (high - low) * (0.5 + 0.5 * wave[..., None]) + rng.normal(0.0, 0.15, (size, size, 3))
            images[i] = np.clip(255 * img, 0, 255).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    classes = np.asarray([f"{d} degrees" for d in (0, 45, 90, 135)])
    np.savez(path, classes=classes, **arrays)
    return path


def random_inputs(work: Path, variant: str, images: int) -> tuple[Path, Path]:
    """A random-init ``variant`` checkpoint (seed 0) and ``images`` random 224 px images of 10 classes, made once
    in ``work`` (also ``lora_memory.py``'s inputs)."""
    from vitkit.checkpoints import vitkit_format
    from vitkit.models import create_model

    ckpt, data = work / f"random-{variant.replace('/', '')}", work / f"random224-{images}.npz"
    if not ckpt.exists():
        torch.manual_seed(0)
        vitkit_format.save(create_model(variant), ckpt)
    if not data.exists():
        rng = np.random.default_rng(0)
        pixels = rng.integers(0, 256, (images, 224, 224, 3), dtype=np.uint8)
        np.savez(data, train_images=pixels, train_labels=np.arange(images) % 10)
    return ckpt, data


# ---- methods ----------------------------------------------------------------------------------------------


def ridge(backbone: Path, data: Path) -> dict[str, Any]:
    """``vitkit fewshot``'s probe (fixed l2 = 2^10) on every training example of ``data``."""
    from vitkit import load_checkpoint
    from vitkit.data.datasets import open_dataset
    from vitkit.evaluate.fewshot import DEFAULT_L2, RidgeProbe
    from vitkit.inference.features import extract

    t0 = time.perf_counter()
    loaded = load_checkpoint(backbone)
    train, test = open_dataset(data, "train"), open_dataset(data, "test")
    from vitkit.inference.features import ExtractOptions

    kw: dict[str, Any] = {"logits": False, "features": True, "opts": ExtractOptions(batch_size=512, progress=False)}
    tr = extract(loaded.model, train, loaded.meta.preprocess, **kw)
    te = extract(loaded.model, test, loaded.meta.preprocess, **kw)
    assert tr.features is not None and te.features is not None
    acc = RidgeProbe(tr.features, tr.labels, len(train.classes)).accuracy(te.features, te.labels, DEFAULT_L2)
    return {"top1": acc, "seconds": time.perf_counter() - t0}


def adapt(backbone: Path, data: Path, method: str, out: Path, cache: Path, **changes: Any) -> dict[str, Any]:
    from vitkit.configs import finetune_config
    from vitkit.data.datasets import open_dataset
    from vitkit.train import train

    n = len(open_dataset(data, "train"))
    cfg = finetune_config(str(backbone), str(data), "finetune-small", (16, 16), method=method)
    common = {"data.workers": 0, "data.eval_batch_size": 512, "adapt.feature_cache": str(cache)}
    common |= {"aug.crop_scale": [0.7, 1.0], "aug.flip": False}  # (linear: its --feature-epochs passes)
    if method != "linear":
        common |= {
            "data.batch_size": min(64, n),
            "checkpoint_every_steps": None,
            "eval_every_epochs": 10**6,
        }  # evaluated once, at the end
    cfg = cfg.override(**(common | changes))
    shutil.rmtree(out, ignore_errors=True)  # this script's own run folders
    t0 = time.perf_counter()
    result = train(cfg, out, progress=False)
    return {"top1": result.final_top1, "seconds": time.perf_counter() - t0, "steps": result.step}


def compare(backbone: Path, data: Path, work: Path, label: str) -> dict[str, Any]:
    # warm-up: the first model load, forward pass and optimiser of a process pay for imports (torch._dynamo...)
    ridge(backbone, data)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    rows: dict[str, Any] = {"ridge": ridge(backbone, data)}
    for method in METHODS:
        shutil.rmtree(work / f"cache-{label}-{method}", ignore_errors=True)  # a cold feature cache
        rows[method] = adapt(backbone, data, method, work / f"{label}-{method}", work / f"cache-{label}-{method}")
        print(label, method, rows[method], flush=True)
    warm = adapt(backbone, data, "linear", work / f"{label}-linear-warm", work / f"cache-{label}-linear",
                 **{"adapt.l2": 1e-2})  # fmt: skip
    rows["linear (warm)"] = warm
    aug = {"adapt.feature_epochs": 4}
    rows["linear +4 aug"] = adapt(
        backbone, data, "linear", work / f"{label}-lin-aug", work / f"cache-{label}-linear", **aug
    )
    return rows


# ---- pieces -----------------------------------------------------------------------------------------------


def cmd_backbone(work: Path, out: Path | None = None) -> None:
    from vitkit.configs import apply_overrides, get_recipe
    from vitkit.train import train

    work.mkdir(parents=True, exist_ok=True)
    lower = digits_npz(work / "lower.npz", low=True)
    digits_npz(work / "upper.npz", low=False)
    shutil.rmtree(work / "backbone", ignore_errors=True)
    t0 = time.perf_counter()
    cfg = apply_overrides(get_recipe("digits"), {"data.source": str(lower)})
    result = train(cfg, work / "backbone", progress=False)
    doc = {"top1": result.final_top1, "seconds": time.perf_counter() - t0, "steps": result.step}
    print(doc)
    save("backbone", doc, out)


def cmd_digits(work: Path, shots: list[str], out: Path | None = None) -> None:
    backbone = work / "backbone"
    upper = work / "upper.npz"
    results = {}
    for k in shots:
        data = upper if k == "full" else shot_npz(upper, work / f"upper-{k}.npz", int(k))
        results[k] = compare(backbone, data, work, f"digits-{k}")
    save(f"digits-{'-'.join(shots)}", {"target": "digits 5-9", "shots": results}, out)


def cmd_photos(work: Path, out: Path | None = None) -> None:
    backbone = work / "backbone"
    full = photos_npz(work / "photos.npz")
    results = {}
    for k in ("10", "full"):
        data = full if k == "full" else shot_npz(full, work / f"photos-{k}.npz", int(k))
        results[k] = compare(backbone, data, work, f"photos-{k}")
    save("photos", {"target": "sample photos, 4 regions", "shots": results}, out)


def cmd_features(work: Path, variant: str, images: int, rounds: int, out: Path | None = None) -> None:
    """The linear method's feature pass for a VARIANT backbone at 224 px: fp32 (the model as it is) against bf16
    and int8 (``--feature-precision``, the fast inference path), each with a cold cache, alternating, ``rounds``
    times; and how far their features are from the fp32 ones."""
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.data.datasets import open_dataset
    from vitkit.train.feature_cache import cached_features

    tag = variant.replace("/", "")
    ckpt, data = random_inputs(work, variant, images)
    from vitkit import load_checkpoint

    model = load_checkpoint(ckpt).model
    ds = open_dataset(data, "train")
    pre = Preprocess((224, 224), (0.5,) * 3, (0.5,) * 3)
    precisions = ("fp32", "bf16", "int8")
    times: dict[str, list[float]] = {p: [] for p in precisions}
    feats: dict[str, np.ndarray] = {}
    for r in range(rounds):
        for precision in precisions:
            cache = work / f"features-{tag}-{precision}"
            shutil.rmtree(cache, ignore_errors=True)  # cold: computed, not read
            t0 = time.perf_counter()
            got = cached_features(model, ds, pre, root=cache, precision=precision, batch_size=32, progress=False)
            times[precision].append(time.perf_counter() - t0)
            feats[precision] = got.features
            print(variant, precision, f"round {r}", f"{times[precision][-1]:.2f} s", flush=True)
    median = {p: statistics.median(times[p]) for p in precisions}
    doc: dict[str, Any] = {"variant": variant, "images": images, "image_size": 224, "batch": 32, "seconds": times}
    for p in precisions:
        err = np.linalg.norm(feats[p] - feats["fp32"]) / np.linalg.norm(feats["fp32"])
        doc[p] = {"img_s": images / median[p], "x_fp32": median["fp32"] / median[p], "rel_err": float(err)}
    print(doc)
    save(f"features-{tag}", doc, out)


# ---- defaults: every method as a user runs it ---------------------------------------------------------------

DEFAULT_SEEDS = (0, 1, 2, 3)
TOP1_LINE = re.compile(r"^test accuracy: ([0-9.]+)%", re.M)
KEPT_LINE = re.compile(r"^kept the weights of step (\d+) of (\d+)", re.M)
LR_LINE = re.compile(r"^lr (\S+) chosen on held-out data", re.M)  # --sweep lr


#: ``defaults --target``: the label of its results and the data set it builds in the work folder
TARGETS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "digits": ("digits 5-9, full split", lambda work: work / "upper.npz"),  # made by the backbone piece
    "photos": ("sample photos, 4 regions, full split", lambda work: photos_npz(work / "photos.npz")),
    "gratings": ("synthetic gratings, 4 orientations", lambda work: gratings_npz(work / "gratings.npz")),
}


def cmd_defaults(
    work: Path, seeds: list[int], target: str = "digits", out: Path | None = None, sweep: bool = False
) -> None:
    """``vitkit finetune backbone --data upper.npz --method M --seed S`` as a user types it (no recipe: the
    schedule sized by the data; a cold feature cache of its own), each in a fresh process: the process's wall
    time from start to saved checkpoint, the test top-1 it prints, and the step whose weights it kept.
    ``sweep``: the methods that train, each with ``--sweep lr`` (the learning rate chosen on the held-out
    split), and the rate each run chose."""
    backbone = work / "backbone"
    label, make_data = TARGETS[target]
    upper = make_data(work)
    methods = [m for m in METHODS if m != "linear"] if sweep else list(METHODS)
    rows: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for seed in seeds:
        for method in methods:
            tag = f"{target}-{method}-{seed}" + ("-sweep" if sweep else "")
            run, cache = work / f"default-{tag}", work / f"default-cache-{tag}"
            shutil.rmtree(run, ignore_errors=True)  # this script's own run folders and caches
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(mode=0o700, parents=True)
            cmd = [sys.executable, "-m", "vitkit", "finetune", str(backbone), "--data", str(upper), "--method", method,
                   "--seed", str(seed), "--out", str(run), "--quiet"]  # fmt: skip
            if method in ("linear", "lp-ft"):  # a cold cache of their own
                cmd += ["--feature-cache", str(cache)]
            cmd += ["--sweep", "lr"] if sweep else []
            t0 = time.perf_counter()
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)}: {done.stderr.strip().splitlines()[-1]}")
            top1 = TOP1_LINE.search(done.stdout)
            kept = KEPT_LINE.search(done.stdout)
            assert top1 is not None, done.stdout
            rows[method][str(seed)] = {
                "top1": float(top1.group(1)) / 100,
                "seconds": seconds,
                "kept_step": int(kept.group(1)) if kept else None,
                "steps": int(kept.group(2)) if kept else 0,
            }
            if sweep:
                chosen = LR_LINE.search(done.stdout)
                assert chosen is not None, done.stdout
                rows[method][str(seed)]["lr"] = float(chosen.group(1))
            schedule = [line for line in done.stderr.splitlines() if "schedule:" in line]
            if schedule:
                rows[method]["schedule"] = schedule[0].removeprefix("note: ")
            print(method, seed, rows[method][str(seed)], flush=True)
    name = "defaults" + ("" if target == "digits" else f"-{target}")
    name += "" if list(seeds) == list(DEFAULT_SEEDS) else f"-{'-'.join(map(str, seeds))}"
    name += "-sweep" if sweep else ""
    save(name, {"target": label, "seeds": seeds, "sweep": sweep, "methods": rows}, out)


def defaults_table(doc: dict[str, Any]) -> None:
    seeds = [str(s) for s in doc["seeds"]]
    rows = doc["methods"]
    methods = [m for m in METHODS if m in rows]  # a sweep's: the methods that train
    sweep = doc.get("sweep", False)
    print(f"\ndefaults{' --sweep lr' if sweep else ''}, {doc['target']} (seeds {', '.join(seeds)}): test top-1 %, "
          "wall s per run\n")  # fmt: skip
    extra = " lr chosen |" if sweep else ""
    print(f"| method | mean | min | per seed | wall mean | wall max | step kept (of) |{extra}")
    print("|---|---|---|---|---|---|---|" + ("---|" if sweep else ""))
    stat: dict[str, dict[str, float]] = {}
    for m in methods:
        r = [rows[m][s] for s in seeds]
        top = [100 * x["top1"] for x in r]
        wall = [x["seconds"] for x in r]
        stat[m] = {"mean": statistics.mean(top), "min": min(top)}
        kept = ", ".join(f"{x['kept_step']}" for x in r) + f" ({r[0]['steps']})" if r[0]["steps"] else "-"
        lrs = " " + ", ".join(f"{x['lr']:g}" for x in r) + " |" if sweep else ""
        print(f"| {m} | {statistics.mean(top):.2f} | {min(top):.2f} | {' / '.join(f'{t:.1f}' for t in top)} | "
              f"{statistics.mean(wall):.1f} | {max(wall):.1f} | {kept} |{lrs}")  # fmt: skip
    if "linear" not in rows:
        return
    lin = [100 * rows["linear"][s]["top1"] for s in seeds]
    lpft = [100 * rows["lp-ft"][s]["top1"] for s in seeds]
    walls = [rows[m][s]["seconds"] for m in METHODS for s in seeds]
    goals = {
        "every run <= 60 s": max(walls) <= 60,
        "lp-ft >= linear on every seed": all(a >= b for a, b in zip(lpft, lin, strict=True)),
        "lp-ft >= full - 0.5 (mean)": stat["lp-ft"]["mean"] >= stat["full"]["mean"] - 0.5,
        "full >= linear (mean)": stat["full"]["mean"] >= stat["linear"]["mean"],
        "lora >= full - 1 (mean)": stat["lora"]["mean"] >= stat["full"]["mean"] - 1,
    }
    print("\n" + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))


# ---- table ------------------------------------------------------------------------------------------------


def cmd_table() -> None:
    def load(name: str) -> dict[str, Any]:
        return json.loads((RESULTS / f"{name}.json").read_text())

    pieces = sorted(p.stem for p in RESULTS.glob("*.json"))
    for name in pieces:
        if name.startswith("defaults"):
            defaults_table(load(name))
    back = load("backbone")
    print(f"Backbone (digits 0-4, default recipe): {100 * back['top1']:.2f}% test top-1, {back['seconds']:.0f} s")
    for target in ("digits", "photos"):
        shots: dict[str, Any] = {}
        for name in pieces:
            if name.startswith(target):
                shots.update(load(name)["shots"])
        if not shots:
            continue
        order = sorted(shots, key=lambda k: (k == "full", int(k) if k.isdigit() else 0))
        methods = ["ridge", *METHODS, "linear (warm)", "linear +4 aug"]
        print(f"\n{target}: top-1 % (wall s)\n")
        print("| shots per class | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        for k in order:
            cells = [
                f"{100 * shots[k][m]['top1']:.1f} ({shots[k][m]['seconds']:.1f})" if m in shots[k] else "-"
                for m in methods
            ]
            print(f"| {k} | " + " | ".join(cells) + " |")
        if "full" in shots:
            f = shots["full"]
            gap = 100 * (f["full"]["top1"] - f["linear"]["top1"])
            speed = f["full"]["seconds"] / f["linear"]["seconds"]
            print(f"\nfull split: linear {gap:+.1f} points below full fine-tuning, {speed:.1f}x less wall time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("piece", choices=["backbone", "defaults", "digits", "photos", "features", "table"])
    p.add_argument("args", nargs="*")
    p.add_argument("--work", type=Path, default=Path("/tmp/vitkit-adaptation"), help="data, runs and caches")
    p.add_argument("--seeds", default="0,1,2,3", help="defaults: comma-separated seeds")
    p.add_argument("--target", choices=list(TARGETS), default="digits", help="defaults: the transfer")
    p.add_argument("--sweep", action="store_true", help="defaults: the methods that train, with --sweep lr")
    p.add_argument("--shots", default="1,5,10,25,full", help="digits: comma-separated shots per class, or full")
    p.add_argument("--images", type=int, default=128, help="features: images to compute features of")
    p.add_argument("--rounds", type=int, default=2, help="features: alternating rounds of fp32 and bf16")
    p.add_argument("--json", type=Path, help="write the piece's results here (not to benchmarks/results/adaptation/)")
    a = p.parse_args()
    if a.piece == "backbone":
        cmd_backbone(a.work, a.json)
    elif a.piece == "defaults":
        cmd_defaults(a.work, [int(s) for s in a.seeds.split(",")], a.target, a.json, a.sweep)
    elif a.piece == "digits":
        cmd_digits(a.work, a.shots.split(","), a.json)
    elif a.piece == "photos":
        cmd_photos(a.work, a.json)
    elif a.piece == "features":
        a.work.mkdir(parents=True, exist_ok=True)
        cmd_features(a.work, a.args[0], a.images, a.rounds, a.json)
    else:
        cmd_table()


if __name__ == "__main__":
    main()
