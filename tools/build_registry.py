"""Writes src/vitkit/resources/vit_registry.json: Google's released ViT checkpoints by short name.

Every number comes from a publication and carries its source; a field is null where none was found.
Parameter counts are not published per file: they are computed here by vitkit for the architecture at the
entry's resolution, without the head (and without the pre-logits layer), and labelled as such.

Sources:
- PAPER = "An Image is Worth 16x16 Words" (arXiv:2010.11929), Table 5: ImageNet top-1 of the ImageNet-21k
  pre-trained models fine-tuned at 384 px (ViT-B/16 83.97, B/32 81.28, L/16 85.15, L/32 80.99, H/14 85.13).
- README = github.com/google-research/vision_transformer README: the bucket layout (imagenet21k,
  imagenet21k+imagenet2012, augreg), the "-224" models "expected to achieve 81.2% and 82.7%" (update of
  29.10.2020), and the table of recommended AugReg checkpoints (sizes, 384 px ImageNet accuracy).
- TIMM = timm 1.0.31 pretrained configs (vision_transformer.py, vision_transformer_hybrid.py): the other
  AugReg file names vit_jax's index holds that timm ships (224 px fine-tunes, ImageNet-1k pre-training, B/8).

Run: PYTHONPATH=src python tools/build_registry.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from vitkit.models import create_model

PAPER = "arXiv:2010.11929 (Dosovitskiy et al.), Table 5: ImageNet-21k pre-training, fine-tuned at 384 px"
README = "https://github.com/google-research/vision_transformer#available-vit-models"
README_224 = "https://github.com/google-research/vision_transformer README, update 29.10.2020 (-224 models)"
TIMM = "timm 1.0.31 pretrained config (timm/models/vision_transformer*.py)"

OFFICIAL_PRE = {"resize": "squash", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear"}

I21K = "ImageNet-21k"
I1K = "ImageNet-1k"


def params(arch: str, res: int) -> int:
    with torch.device("meta"):
        model = create_model(arch, num_classes=0, image_size=res)
    return int(sum(p.numel() for p in model.parameters()))


def entry(
    name: str,
    arch: str,
    url: str,
    res: int,
    pretrain: str,
    finetune: str | None,
    source: str,
    top1: float | None = None,
    top1_source: str | None = None,
    size_mib: int | None = None,
    family: str = "paper",
    aliases: tuple[str, ...] = (),
) -> dict[str, Any]:
    classes = 1000 if finetune == I1K or pretrain == I1K else 21843
    return {
        "name": name,
        "aliases": list(aliases),
        "family": family,
        "architecture": arch,
        "url": url,
        "format": "official",
        "resolution": res,
        "num_classes": classes,
        "label_set": "imagenet-1k" if classes == 1000 else "imagenet-21k",
        "pretrain": pretrain,
        "finetune": finetune,
        "preprocess": OFFICIAL_PRE,
        "params_without_head": params(arch, res),
        "top1": top1,
        "top1_dataset": "ImageNet-1k val" if top1 is not None else None,
        "top1_source": top1_source,
        "size_mib": size_mib,
        "sha256": None,  # Google publishes none: recorded on first download
        "source": source,
    }


def paper_entries() -> list[dict[str, Any]]:
    out = []
    i21k = [("B_16", "B/16"), ("B_32", "B/32"), ("L_16", "L/16"), ("L_32", "L/32"), ("H_14", "H/14")]
    for f, arch in i21k:
        out.append(entry(f"ViT-{f}-i21k", arch, f"gs://vit_models/imagenet21k/ViT-{f}.npz", 224, I21K, None, README))
    out.append(
        entry("R50+ViT-B_16-i21k", "R50+B/16", "gs://vit_models/imagenet21k/R50+ViT-B_16.npz", 224, I21K, None, README)
    )
    table5 = {"B_16": 83.97, "B_32": 81.28, "L_16": 85.15, "L_32": 80.99}
    for f, arch in i21k[:4]:
        out.append(
            entry(
                f"ViT-{f}-i21k-i1k-384",
                arch,
                f"gs://vit_models/imagenet21k+imagenet2012/ViT-{f}.npz",
                384,
                I21K,
                I1K,
                README,
                top1=table5[f],
                top1_source=PAPER,
            )
        )
    for f, arch, acc in (("B_16", "B/16", 81.2), ("L_16", "L/16", 82.7)):
        out.append(
            entry(
                f"ViT-{f}-i21k-i1k-224",
                arch,
                f"gs://vit_models/imagenet21k+imagenet2012/ViT-{f}-224.npz",
                224,
                I21K,
                I1K,
                README,
                top1=acc,
                top1_source=README_224,
            )
        )
    out.append(
        entry(
            "R50+ViT-B_16-i21k-i1k-384",
            "R50+B/16",
            "gs://vit_models/imagenet21k+imagenet2012/R50+ViT-B_16.npz",
            384,
            I21K,
            I1K,
            README,
        )
    )
    return out


# The README's recommended AugReg checkpoints: (arch, pre-trained file, size MiB, fine-tuned file, top-1 at 384).
AUGREG_RECOMMENDED = [
    ("L/16", "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0", 1243,
     "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384", 85.59),
    ("B/16", "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", 391,
     "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384", 85.49),
    ("S/16", "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", 115,
     "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384", 83.73),
    ("R50+L/32", "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1", 1337,
     "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_384", 85.99),
    ("R26+S/32", "R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", 170,
     "R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384", 83.85),
    ("Ti/16", "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", 37,
     "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384", 78.22),
    ("B/32", "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", 398,
     "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384", 83.59),
    ("S/32", "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0", 118,
     "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384", 79.58),
    ("R+Ti/16", "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", 40,
     "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384", 75.40),
]  # fmt: skip

# Further AugReg files of vit_jax's index that timm ships (no accuracy found in the publications' text here).
AUGREG_TIMM = [
    "B_16-i1k-300ep-lr_0.001-aug_strong2-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
    "B_16-i1k-300ep-lr_0.001-aug_strong2-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_384",
    "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
    "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384",
    "B_32-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
    "B_32-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_384",
    "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384",
    "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0",
    "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
    "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
    "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1",
    "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
    "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_384",
    "S_16-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
    "S_16-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384",
    "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0",
    "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384",
    "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "R26_S_32-i21k-300ep-lr_0.001-aug_light0-wd_0.03-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.03-res_224",
    "R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0",
    "R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384",
    "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
    "R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0",
    "R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384",
    "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
]


def augreg_arch(stem: str) -> str:
    """vit_jax's file prefix -> vitkit's variant name: B_16 -> B/16, R26_S_32 -> R26+S/32, R_Ti_16 -> R+Ti/16."""
    prefix = stem.split("-", 1)[0]
    m = re.fullmatch(r"(?:(R\d*)_)?([A-Za-z]+)_(\d+)", prefix)
    assert m, prefix
    return (f"{m.group(1)}+" if m.group(1) else "") + f"{m.group(2)}/{m.group(3)}"


def augreg_entry(arch: str, stem: str, source: str, top1: float | None = None, size: int | None = None) -> dict:
    fine = "--imagenet2012-" in stem
    res = int(stem.rsplit("res_", 1)[1]) if fine else 224
    pre = I1K if "-i1k-" in stem else I21K
    return entry(
        stem, arch, f"gs://vit_models/augreg/{stem}.npz", res, pre, I1K if fine else None, source,
        top1=top1, top1_source=README if top1 is not None else None, size_mib=size, family="augreg",
    )  # fmt: skip


def augreg_entries() -> list[dict[str, Any]]:
    out = []
    for arch, pre, size, fine, acc in AUGREG_RECOMMENDED:
        out.append(augreg_entry(arch, pre, README, size=size))
        out.append(augreg_entry(arch, fine, README, top1=acc))
    out += [augreg_entry(augreg_arch(stem), stem, TIMM) for stem in AUGREG_TIMM]
    return sorted(out, key=lambda e: e["name"])


def main() -> None:
    entries = paper_entries() + augreg_entries()
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), "duplicate names"
    doc = {
        "about": "Google's released ViT checkpoints (vit_jax .npz). Accuracies are ImageNet-1k top-1 as published "
        "(top1_source); params_without_head is computed by vitkit (no head, no pre-logits) at the entry's "
        "resolution. Generated by tools/build_registry.py.",
        "models": entries,
    }
    out = Path(__file__).resolve().parents[1] / "src" / "vitkit" / "resources" / "vit_registry.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}: {len(entries)} models")


if __name__ == "__main__":
    main()
