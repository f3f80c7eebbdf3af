"""What tools/ray_overhead.py and tools/ray_scale.py measure on: ``n`` photo-like 320x256 JPEGs (smooth noise,
quality 90) in a new temporary folder and a random ViT-S/16 checkpoint at 224 px beside them, loaded."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def jpegs_and_checkpoint(n: int, prefix: str) -> tuple[Path, list[str], Any]:
    """(the folder, the JPEGs' paths, the loaded checkpoint)."""
    import vitkit
    from vitkit.checkpoints import load_checkpoint
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.models import create_model

    root = Path(tempfile.mkdtemp(prefix=prefix))
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):  # smooth photos-like noise, 320x256 JPEGs
        small = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
        Image.fromarray(small).resize((320, 256), Image.BILINEAR).save(root / f"{i:05d}.jpg", quality=90)
        paths.append(str(root / f"{i:05d}.jpg"))
    ckpt = vitkit.save_pretrained(create_model("S/16", num_classes=10).eval(), root / "m",
                                  preprocess=Preprocess(image_size=224))  # fmt: skip
    return root, paths, load_checkpoint(ckpt)
