"""Batched forward passes over a dataset: logits and frozen pre-logits features, with a progress bar.

Works with any dataset that follows vitkit's data interface: map-style (``__len__`` and ``__getitem__ ->
(PIL image, label)``) or iterable-only (streaming shards), preprocessed with the checkpoint's
:class:`~vitkit.checkpoints.preprocess.Preprocess`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, DataError
from vitkit.hardware import resolve_device
from vitkit.models.vit import VisionTransformer


def is_map_style(dataset: Any) -> bool:
    """Whether the dataset supports ``len`` and random access (else it is streamed in order)."""
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


class _Prepared(torch.utils.data.Dataset):
    """Map-style view that preprocesses examples and remembers their dataset index."""

    def __init__(self, dataset: Any, preprocess: Preprocess, indices: Sequence[int]) -> None:
        self.dataset, self.preprocess, self.indices = dataset, preprocess, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[torch.Tensor, int, int]:
        i = self.indices[j]
        img, label = self.dataset[i]
        name = self.dataset.describe(i) if hasattr(self.dataset, "describe") else f"example {i}"
        return self.preprocess.to_tensor(img, name), int(label), i


def iterate_batches(
    dataset: Any,
    preprocess: Preprocess,
    batch_size: int,
    indices: Sequence[int] | None = None,
    workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (images (B, C, H, W), labels (B,), dataset indices (B,)) in dataset order.

    ``indices`` restricts a map-style dataset to those examples; ``workers`` > 0 decodes in worker
    processes (map-style only).
    """
    if is_map_style(dataset):
        chosen = range(len(dataset)) if indices is None else indices
        loader = torch.utils.data.DataLoader(
            _Prepared(dataset, preprocess, chosen), batch_size=batch_size, shuffle=False, num_workers=workers
        )
        yield from loader
        return
    if indices is not None:
        raise DataError("this dataset can only be streamed; selecting examples by index needs a map-style dataset")
    xs: list[torch.Tensor] = []
    ys: list[int] = []
    for i, (img, label) in enumerate(dataset):
        xs.append(preprocess.to_tensor(img, f"example {i}"))
        ys.append(int(label))
        if len(xs) == batch_size:
            yield torch.stack(xs), torch.tensor(ys), torch.arange(i + 1 - len(xs), i + 1)
            xs, ys = [], []
    if xs:
        n = len(xs)
        yield torch.stack(xs), torch.tensor(ys), torch.arange(i + 1 - n, i + 1)


@dataclass
class Extracted:
    """Per-example outputs of :func:`extract`, in the order the examples were visited."""

    labels: np.ndarray  # (N,) int64
    indices: np.ndarray  # (N,) int64 dataset indices
    logits: np.ndarray | None = None  # (N, K) float32
    features: np.ndarray | None = None  # (N, R) float32, pre-logits representation


@torch.inference_mode()
def extract(
    model: VisionTransformer,
    dataset: Any,
    preprocess: Preprocess,
    *,
    logits: bool = True,
    features: bool = False,
    batch_size: int = 64,
    device: torch.device | str | None = "cpu",
    indices: Sequence[int] | None = None,
    workers: int = 0,
    desc: str = "extract",
    progress: bool = True,
) -> Extracted:
    """Run the model over a dataset in batches, collecting logits and/or pre-logits features.

    Features are the frozen representation the paper's linear probes use: the pooled token after the
    optional pre-logits layer (``forward_head(tokens, pre_logits=True)``).
    """
    if not (logits or features):
        raise ValueError("nothing to extract: ask for logits, features or both")
    if logits and model.cfg.num_classes <= 0:
        raise ConfigError("the model has no classification head (num_classes=0); logits are not defined")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model = model.eval().to(dev)
    total = None
    if is_map_style(dataset):
        n = len(dataset) if indices is None else len(indices)
        total = -(-n // batch_size)
    out_logits: list[np.ndarray] = []
    out_feats: list[np.ndarray] = []
    out_labels: list[np.ndarray] = []
    out_idx: list[np.ndarray] = []
    batches = iterate_batches(dataset, preprocess, batch_size, indices, workers)
    for x, y, idx in tqdm(batches, desc=desc, total=total, unit="batch", file=sys.stderr, disable=not progress):
        rep = model.forward_head(model.forward_features(x.to(dev)), pre_logits=True)  # (B, R)
        if features:
            out_feats.append(rep.float().cpu().numpy())
        if logits:
            out_logits.append(model.head(rep).float().cpu().numpy())  # (B, K)
        out_labels.append(y.numpy().astype(np.int64))
        out_idx.append(idx.numpy().astype(np.int64))
    if not out_labels:
        raise DataError("the dataset has no examples")
    return Extracted(
        labels=np.concatenate(out_labels),
        indices=np.concatenate(out_idx),
        logits=np.concatenate(out_logits) if logits else None,
        features=np.concatenate(out_feats) if features else None,
    )
