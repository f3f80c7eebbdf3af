"""Feeds the table "Input pipeline" of BENCHMARKS.md (``python benchmarks/run_all.py input_pipeline``).

Training input pipeline on photo-sized JPEGs: decode + inception crop + flip + normalise, images per second
of one worker (one process, one thread), vitkit's sample path against the plain Pillow full decode; and
the default-worker loader of the S/16 recipe against the S/16 training step it feeds.

    PYTHONPATH=src python benchmarks/input_pipeline.py [--images 200] [--sizes 224,160,128] [--rounds 5] [--json F]

The ImageFolder is made here from scikit-learn's two sample photos (china.jpg, flower.jpg, 640x427):
random 4:3 crops resized to 500x375 (every fourth one turned to portrait 375x500), random flips, JPEG
quality 90 (Pillow's default 4:2:0), one class per photo.

- plain: ``Image.open(f).convert("RGB")`` (full decode), the same inception-crop box, Pillow bilinear
  resize of that box, flip, ``(np.asarray(img, float32) / 255 - mean) / std`` then CHW: the textbook path
  (and vitkit's before this benchmark).
- vitkit: ``ImageFolder.lazy_item`` + ``TrainTransform`` (the trainer's path): the file is read and its
  JPEG header parsed (``images.EncodedJpeg``), the crop box drawn, the JPEG decoded by libjpeg-turbo
  (simplejpeg) straight into an array (at 1/2, 1/4 or 1/8 scale only for images of at least
  ``REDUCED_DECODE_PIXELS``: none here), the box resized by PyTorch's antialiased uint8 kernel, flipped,
  normalised.
- vitkit, full decode: the same transform given images already decoded by Pillow.
- vitkit, WebDataset: the same JPEGs packed into one tar shard, ``WebDataset.lazy_item`` + the transform.

Each round runs the four over every image (same seeds, so the same boxes), rounds alternate; medians.
Same region: for every sample, mean |vitkit - plain| in 0..255 levels (the trainer's path, flip off),
against the same for the plain crop moved by 2 px (full-resolution pixels): the first must be far below
the second.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD
from vitkit.data.datasets import open_dataset
from vitkit.data.transforms import TrainTransform, inception_crop_box, sample_rng


def make_folder(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` JPEGs of 500x375 / 375x500 in root/train/{china,flower}/."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    rng = np.random.default_rng(seed)
    for i in range(n):
        k = i % 2
        src = photos.images[k]
        H, W = src.shape[:2]
        w = int(rng.integers(320, W + 1))
        h = min(H, round(w * 3 / 4))
        x, y = int(rng.integers(0, W - w + 1)), int(rng.integers(0, H - h + 1))
        img = Image.fromarray(src[y : y + h, x : x + w]).resize((500, 375), Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if i % 4 == 3:
            img = img.transpose(Image.Transpose.ROTATE_90)
        folder = root / "train" / Path(photos.filenames[k]).stem
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:04d}.jpg", quality=90)
    return root


def plain_sample(path: str, size: int, rng: np.random.Generator, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    img = Image.open(path).convert("RGB")  # full decode
    box = inception_crop_box(img.width, img.height, rng)
    img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = (np.asarray(img, dtype=np.float32) / 255.0 - mean) / std
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def moved_box(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` moved by 2 px along each axis where it fits (right/down, else left/up)."""
    dx = 2 if box[2] + 2 <= width else (-2 if box[0] >= 2 else 0)
    dy = 2 if box[3] + 2 <= height else (-2 if box[1] >= 2 else 0)
    return box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy


def region_check(ds, size: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Over every sample: mean |vitkit - plain| (the trainer's path, flip off, 0..255 levels), the same
    inside the outermost rows and columns, and plain against the plain box moved by 2 px."""
    tf = TrainTransform((size, size), flip=False)  # mean = std = 0.5
    same, inner, moved = [], [], []
    for i in range(len(ds)):
        x = tf(ds.lazy_item(i)[0], sample_rng(0, 0, i))  # (3, H, W)
        ours = (x.numpy().transpose(1, 2, 0) * 0.5 + 0.5) * 255.0
        full = Image.open(ds.paths[i]).convert("RGB")
        box = inception_crop_box(full.width, full.height, sample_rng(0, 0, i), tf.crop_scale, tf.crop_ratio)
        ref = np.asarray(full.resize((size, size), Image.Resampling.BILINEAR, box=box), dtype=np.float32)
        shifted = moved_box(box, full.width, full.height)
        other = np.asarray(full.resize((size, size), Image.Resampling.BILINEAR, box=shifted), dtype=np.float32)
        same.append(float(np.abs(ours - ref).mean()))
        inner.append(float(np.abs(ours - ref)[1:-1, 1:-1].mean()))
        moved.append(float(np.abs(other - ref).mean()))
    return statistics.mean(same), statistics.mean(inner), statistics.mean(moved)


def make_shard(root: Path, out: Path) -> Path:
    """The ImageFolder's JPEGs as one WebDataset shard (``NNNN.jpg`` + ``NNNN.cls``)."""
    classes = sorted(d.name for d in (root / "train").iterdir())
    with tarfile.open(out, "w") as tar:
        for label, cls in enumerate(classes):
            for f in sorted((root / "train" / cls).glob("*.jpg")):
                tar.add(f, arcname=f"{cls}-{f.stem}.jpg")
                data = str(label).encode()
                info = tarfile.TarInfo(f"{cls}-{f.stem}.cls")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out


def per_worker(ds, shard, sizes: list[int], rounds: int) -> dict:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)  # a DataLoader worker's setting
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    n = len(ds)
    print(f"\nper worker (1 process, 1 thread), {n} JPEGs, inception crop (0.05-1, 3/4-4/3) + flip + normalise")
    print(
        "| output | plain Pillow full decode (img/s) | vitkit, image already decoded | vitkit (trainer's path) "
        "| vitkit, WebDataset shard | vitkit / plain |"
    )
    print("|---|---|---|---|---|---|")
    result: dict = {}
    for size in sizes:
        tf = TrainTransform((size, size), mean=IMAGENET_MEAN, std=IMAGENET_STD)
        runs: dict[str, list[float]] = {"plain": [], "eager": [], "lazy": [], "wds": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(n):
                plain_sample(ds.paths[i], size, sample_rng(0, 0, i), mean, std)
            runs["plain"].append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(n):
                tf(ds[i][0], sample_rng(0, 0, i))
            runs["eager"].append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(n):
                tf(ds.lazy_item(i)[0], sample_rng(0, 0, i))
            runs["lazy"].append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(len(shard)):
                tf(shard.lazy_item(i)[0], sample_rng(0, 0, i))
            runs["wds"].append(len(shard) / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in runs.items()}
        result[f"{size}px"] = {
            "img_per_s": med,
            "vitkit_over_plain": med["lazy"] / med["plain"],
            "rounds_vitkit_over_plain": [a / b for a, b in zip(runs["lazy"], runs["plain"], strict=True)],
        }
        print(
            f"| {size} px | {med['plain']:.0f} | {med['eager']:.0f} | {med['lazy']:.0f} | {med['wds']:.0f} | "
            f"**{med['lazy'] / med['plain']:.2f}x** (rounds: "
            + ", ".join(f"{a / b:.2f}" for a, b in zip(runs["lazy"], runs["plain"], strict=True))
            + ") |"
        )
    print("\nsame region (every sample; mean |difference| in 0..255 levels):")
    for size in sizes:
        same, inner, moved = region_check(ds, size)
        result[f"{size}px"]["mean_abs_diff_levels"] = {"vs_plain": same, "inner": inner, "plain_moved_2px": moved}
        print(
            f"  {size} px: vitkit vs plain {same:.2f} (inside the outermost rows/columns {inner:.2f}); "
            f"plain vs plain moved 2 px {moved:.2f}"
        )
    return result


def loader_vs_step(root: Path, steps: int) -> dict:
    """The plain-vit-s16 recipe on this folder, batch 32: training step img/s on a fixed batch (loader
    idle), then the loader alone with the trainer's default worker count (no training running)."""
    from vitkit.configs import get_recipe
    from vitkit.train.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = get_recipe("plain-vit-s16", source=str(root)).override(
        **{"data.batch_size": 32, "data.val_split": None, "optim.warmup_steps": 10}, steps=1000
    )
    with tempfile.TemporaryDirectory() as out, Trainer(cfg, Path(out) / "run", progress=False) as tr:
        batches = [g for g, _ in zip(tr.loader.epoch(0), range(2), strict=False)]
        tr.train_step(batches[0])  # warm-up
        t0 = time.perf_counter()
        for s in range(steps):
            tr.train_step(batches[s % len(batches)])
        step_ips = steps * 32 / (time.perf_counter() - t0)
        t0, images = time.perf_counter(), 0
        for epoch in range(2):
            for group in tr.loader.epoch(epoch):
                images += sum(b.images.shape[0] for b in group)
        load_ips = images / (time.perf_counter() - t0)
        print(
            f"\nS/16 (plain-vit-s16 recipe: RandAugment(2, 10), Mixup 0.2, {cfg.precision}), batch 32:\n"
            f"  training step {step_ips:.1f} img/s ({steps} steps, fixed batch)\n"
            f"  loader, {tr.workers} workers (the trainer's default on {os.cpu_count()} cores), 2 epochs: "
            f"{load_ips:.0f} img/s = {load_ips / step_ips:.1f}x the step"
        )
    return {
        "step_img_per_s": step_ips,
        "loader_img_per_s": load_ips,
        "workers": tr.workers,
        "loader_over_step": load_ips / step_ips,
    }


def cpu_name() -> str:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--sizes", default="224,160,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="S/16 training steps timed (0: skip)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    report: dict = {"cpu": cpu_name(), "images": args.images, "rounds": args.rounds}
    print(f"{cpu_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        root = make_folder(Path(tmp) / "photos", args.images)
        ds = open_dataset(str(root), "train")
        shard = open_dataset(str(make_shard(root, Path(tmp) / "train-000000.tar")), "train")
        report["per_worker"] = per_worker(ds, shard, [int(s) for s in args.sizes.split(",")], args.rounds)
        if args.steps:
            report["s16_loader_vs_step"] = loader_vs_step(root, args.steps)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
