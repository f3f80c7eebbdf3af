"""Feeds the table "Does int8 change predictions?" of BENCHMARKS.md (``python benchmarks/run_all.py
int8_agreement``).

Top-1 agreement of the fast bf16 and int8 paths with fp32, on a ViT whose predictions mean something.

No pretrained ViT weights exist on this machine, so this script trains one: a ViT-Ti with 4x4 patches on
scikit-learn's 8x8 digits (upscaled to 32x32, RGB), a few epochs of AdamW, then compares fp32, the
bf16 fast path and the int8 fast path on the held-out digits: accuracy of each and top-1 agreement with
fp32. Run (about five minutes on 2 cores, most of it training):

    PYTHONPATH=src python benchmarks/digits_agreement.py [--checkpoint /tmp/digits_ti4.pt] [--json F]

``--checkpoint PATH``: the trained weights are saved there, and read from there (no training) when the file
exists, so that several versions of the fast paths can be compared on the same model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from vitkit import Preprocess, create_model, optimize_for_inference


def digits_tensors(size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    pre = Preprocess(image_size=(size, size), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    images = [Image.fromarray((img * 255 / 16).astype(np.uint8)).convert("RGB") for img in data.images]
    x = torch.stack([pre.to_tensor(img) for img in images])
    y = torch.as_tensor(data.target)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.25, random_state=0, stratify=y)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def train(model: torch.nn.Module, x_train: torch.Tensor, y_train: torch.Tensor, epochs: int = 15) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    batch = 64
    steps = epochs * (len(y_train) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(y_train))
        for i in range(len(y_train) // batch):
            idx = perm[i * batch : (i + 1) * batch]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x_train[idx]).float(), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="save the trained weights here; read them if it exists")
    ap.add_argument("--epochs", type=int, default=15, help="training epochs (fewer: a weaker model, quicker)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits_tensors()
    model = create_model("Ti/4", image_size=32, num_classes=10)
    start = time.time()
    if args.checkpoint is not None and args.checkpoint.is_file():
        model.load_state_dict(torch.load(args.checkpoint, weights_only=True))
    else:
        train(model, x_train, y_train, args.epochs)
        if args.checkpoint is not None:
            torch.save(model.state_dict(), args.checkpoint)
    model.eval()
    report: dict[str, object] = {
        "train_seconds": round(time.time() - start, 1),
        "epochs": args.epochs,
        "test_images": len(y_test),
    }
    with torch.inference_mode():
        ref = model(x_test).float()
        outputs = {
            "fp32": ref,
            "fast-bf16": optimize_for_inference(model)(x_test).float(),
            "fast-int8": optimize_for_inference(model, int8=True)(x_test).float(),
        }
    for name, out in outputs.items():
        report[name] = {
            "accuracy": float((out.argmax(-1) == y_test).float().mean()),
            "top1_agreement_with_fp32": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
            "rel_err": float((out - ref).norm() / ref.norm()),
        }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
