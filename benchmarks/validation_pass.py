"""Feeds the table "Batch inference: the validation pass of train" of BENCHMARKS.md (``python
benchmarks/run_all.py validation_pass``): what a training run's validation pass costs on the model itself against
the inference engine rebuilt from the current weights (packing included).

For the default ``vitkit train`` job (the digits recipe's model, its 359 test images at 16 px, batch 512) and
for S/16 and B/16 at 224 px (``--images`` random images, batch 32): the seconds of one validation pass with the
training model's own forward (what ``Trainer.evaluate`` ran before; fp32, the default training precision)
and with ``InferenceEngine(..., precision="fp32", fp32_reference=False)`` built from the weights first (what it
runs now), alternating, best of ``--repeats``::

    python benchmarks/validation_pass.py [--images 64] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.configs import get_recipe
from vitkit.data.datasets import open_dataset
from vitkit.inference.engine import InferenceEngine
from vitkit.models import create_model
from vitkit.train import build


def passes(model: torch.nn.Module, pre: Preprocess, batches: list[torch.Tensor], repeats: int) -> dict[str, float]:
    def eager() -> None:
        with torch.no_grad():
            for x in batches:
                model(x)

    def engine() -> None:
        eng = InferenceEngine(model, pre, precision="fp32", fp32_reference=False, batch_size=batches[0].shape[0])
        for x in batches:
            eng.logits(x)

    best = {"model": float("inf"), "engine": float("inf")}
    eager()
    engine()
    for _ in range(repeats):
        for name, fn in (("model", eager), ("engine", engine)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64, help="validation images of the 224 px models (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="*", default=["S/16", "B/16"], help="224 px models besides the digits one")
    p.add_argument("--json", type=Path, help="also write the seconds to this file")
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = get_recipe("digits")
    test = open_dataset("digits", "test")
    model, pre = build.build_model(cfg, test.classes)
    x = torch.stack([pre.to_tensor(img) for img, _ in test])
    cases = [("digits recipe (16 px, 359 images)", model.eval(), pre, [x])]
    for name in args.models:
        m = create_model(name, num_classes=10).eval()
        xs = [torch.randn(32, 3, 224, 224) for _ in range(max(1, args.images // 32))]
        cases.append((f"{name} (224 px, {32 * len(xs)} images)", m, Preprocess(), xs))
    print("| model | model's own forward | engine, packed from the weights each pass | engine / model |")
    print("|---|---|---|---|")
    results = {}
    for label, m, pr, batches in cases:
        t = passes(m, pr, batches, args.repeats)
        results[label] = {**t, "engine_over_model": t["engine"] / t["model"]}
        print(f"| {label} | {t['model']:.3f} s | {t['engine']:.3f} s | {t['engine'] / t['model']:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
