"""Classify image files with a model or checkpoint: ``vitkit.predict(...)`` (what ``vitkit predict`` prints)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from tqdm import tqdm

from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.checkpoints.preprocess import load_image
from vitkit.errors import VitkitError


@dataclass
class Prediction:
    """The ``top`` labels of one image, most probable first, as (label, probability)."""

    image: str
    top: list[tuple[str, float]]


def predict(
    checkpoint: str | os.PathLike[str] | Loaded,
    images: Sequence[str | os.PathLike[str] | Image.Image],
    *,
    top_k: int = 5,
    batch_size: int = 32,
    format: str | None = None,
    progress: bool = False,
) -> list[Prediction]:
    """Top-``top_k`` labels with softmax probabilities for each image.

    ``checkpoint``: any supported checkpoint (or an already loaded one); its preprocessing is applied and its
    class names label the output. Every image file is decoded and its size checked against the preprocessing
    first, so a bad one fails before any compute.
    """
    loaded = checkpoint if isinstance(checkpoint, Loaded) else load_checkpoint(checkpoint, format=format)
    model, pre = loaded.model, loaded.meta.preprocess
    if model.cfg.num_classes <= 0:
        where = loaded.meta.source if isinstance(checkpoint, Loaded) else os.fspath(checkpoint)
        raise VitkitError(f"{where}: the model has no classification head; nothing to predict")
    decoded = [img if isinstance(img, Image.Image) else load_image(img) for img in images]
    names = [f"image {i}" if isinstance(img, Image.Image) else os.fspath(img) for i, img in enumerate(images)]
    for img, name in zip(decoded, names, strict=True):
        pre.check_size(img.width, img.height, name)  # e.g. a line of pixels under a centre crop
    k = min(top_k, model.cfg.num_classes)
    starts = range(0, len(decoded), batch_size)
    out: list[Prediction] = []
    with torch.inference_mode():
        for start in tqdm(
            starts, desc="predict", unit="batch", disable=not progress or len(starts) < 2, file=sys.stderr
        ):
            batch = range(start, min(start + batch_size, len(decoded)))
            x = torch.stack([pre.to_tensor(decoded[i], names[i]) for i in batch])  # (B, C, H, W)
            top_p, top_i = model(x).float().softmax(dim=-1).topk(k, dim=-1)  # (B, k)
            for j in range(x.shape[0]):
                pairs = [(loaded.label(int(i)), float(p)) for p, i in zip(top_p[j], top_i[j], strict=True)]
                out.append(Prediction(names[start + j], pairs))
    return out
