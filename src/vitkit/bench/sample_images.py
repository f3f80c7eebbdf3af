"""Real images for output-agreement checks, from what scikit-learn ships (nothing is downloaded).

The two sample photos (``china.jpg``, ``flower.jpg``), each whole, as four corner crops and a centre crop,
and all of those mirrored (24 images), plus the first images of the 8x8 digits data set upscaled. They
are not a benchmark of accuracy: they are natural-image inputs on which two implementations' predictions
are compared.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vitkit.checkpoints.preprocess import Preprocess


def sample_photos() -> list[Image.Image]:
    """The two photos, their four corner crops and centre crop, and the mirror of each: 24 RGB images."""
    from sklearn.datasets import load_sample_image

    out = []
    for name in ("china.jpg", "flower.jpg"):
        img = Image.fromarray(load_sample_image(name))
        w, h = img.size
        s = min(w, h) * 2 // 3
        boxes = [(0, 0, s, s), (w - s, 0, w, s), (0, h - s, s, h), (w - s, h - s, w, h)]
        boxes.append(((w - s) // 2, (h - s) // 2, (w + s) // 2, (h + s) // 2))
        views = [img, *(img.crop(b) for b in boxes)]
        out += views + [v.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for v in views]
    return out


def digit_images(count: int = 104) -> list[Image.Image]:
    """The first ``count`` 8x8 digits (0-16 grey levels) as RGB images, for upscaling by the preprocessing."""
    from vitkit.data.digits import load_digits_arrays

    images = load_digits_arrays()[0][:count]  # (n, 8, 8) in [0, 16]
    return [Image.fromarray((255 - img * 255 / 16).astype(np.uint8)).convert("RGB") for img in images]


def real_image_batch(pre: Preprocess, digits: int = 104) -> torch.Tensor:
    """All the photos and ``digits`` digit images, preprocessed: (24 + digits, C, H, W)."""
    return torch.stack([pre.to_tensor(img) for img in sample_photos() + digit_images(digits)])
