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

``--family``: the block of a descendant family at the same Ti/4 size (``dinov2``: 4 registers and layer scale;
``siglip``: no class token, a MAP head and tanh-GELU). Besides the logits, each path's embedding (the family's
default: ``forward_head(..., pre_logits=True)``, the class token or the MAP output) is compared with fp32's: the
mean cosine over the held-out digits, and the top-1 agreement of a 1-nearest-neighbour classifier (cosine) whose
gallery is the training digits embedded by the same path, with fp32's.
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


FAMILIES = {
    "vit": {},
    "dinov2": {"num_registers": 4, "layer_scale": 1e-1},
    "siglip": {"class_token": False, "classifier": "map", "gelu": "tanh"},
}


def embed(path: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's default embedding of ``x`` by ``path`` (the model or a fast path), L2-normalised, fp32."""
    feats = path.forward_head(path.forward_features(x), pre_logits=True)  # type: ignore[operator]
    return F.normalize(feats.float(), dim=-1)


def knn_top1(gallery: torch.Tensor, labels: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The label of each query's nearest gallery vector (cosine; the vectors are normalised)."""
    return labels[(queries @ gallery.T).argmax(-1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="save the trained weights here; read them if it exists")
    ap.add_argument("--epochs", type=int, default=15, help="training epochs (fewer: a weaker model, quicker)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="vit", help="the block's family (default vit)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits_tensors()
    model = create_model("Ti/4", image_size=32, num_classes=10, **FAMILIES[args.family])
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
        "family": args.family,
        "epochs": args.epochs,
        "test_images": len(y_test),
    }
    paths = {
        "fp32": model,
        "fast-bf16": optimize_for_inference(model),
        "fast-int8": optimize_for_inference(model, int8=True),
    }
    assert all(type(p).__name__ == "InferenceViT" for n, p in paths.items() if n != "fp32"), "the fast path did not run"
    with torch.inference_mode():
        ref = model(x_test).float()
        ref_emb, ref_gallery = embed(model, x_test), embed(model, x_train)
        ref_knn = knn_top1(ref_gallery, y_train, ref_emb)
        for name, path in paths.items():
            out = path(x_test).float()
            emb = embed(path, x_test)
            knn = knn_top1(embed(path, x_train), y_train, emb)
            report[name] = {
                "accuracy": float((out.argmax(-1) == y_test).float().mean()),
                "top1_agreement_with_fp32": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
                "rel_err": float((out - ref).norm() / ref.norm()),
                "embedding_cosine_with_fp32": float((emb * ref_emb).sum(-1).mean()),
                "embedding_cosine_min": float((emb * ref_emb).sum(-1).min()),
                "knn_accuracy": float((knn == y_test).float().mean()),
                "knn_top1_agreement_with_fp32": float((knn == ref_knn).float().mean()),
            }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
