"""``vitkit analyze``: the paper's figures 6, 7 and 11 for any checkpoint, as PNGs plus a JSON summary.

Weight-only analyses (patch-embedding PCA, position-embedding similarity) need no images; the attention
analyses (mean attention distance, rollout, raw maps) run the model's attention path batched over the given
images on any device.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from vitkit.analysis import plots
from vitkit.analysis.attention import (
    attention_maps,
    distance_matrix,
    mean_attention_distance,
    rollout_maps,
    upsample_maps,
)
from vitkit.analysis.embeddings import (
    NotApplicable,
    patch_embedding_pca,
    position_embeddings,
    position_similarity,
    similarity_summary,
)
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.fileio import check_report_dir, write_text_atomic
from vitkit.images import convert_image
from vitkit.models.vit import VisionTransformer

MAX_HEAD_MAP_ROWS = 4


@dataclass(frozen=True)
class AnalyzeOptions:
    """What to compute and draw."""

    layer: int = -1  # layer of the raw attention maps, 0-based (negative: from the end)
    head: int | None = None  # head of the raw attention maps, 0-based (None: all heads)
    batch_size: int = 16
    max_overlays: int = 8  # images shown in the rollout figure (the per-head figure shows at most 4)
    num_components: int = 28  # principal components of the patch-embedding filters
    renormalize: bool = True  # mean attention distance: renormalise attention over patch keys


@dataclass
class AttentionResult:
    """Attention analyses over a set of images."""

    mean_distance: np.ndarray  # (L, h) pixels, averaged over images
    rollout: np.ndarray  # (n, H, W) in [0, 1], first ``max_overlays`` images
    layer_maps: np.ndarray  # (n, heads, H, W) in [0, 1]
    num_images: int


def _check_layer_head(model: VisionTransformer, opts: AnalyzeOptions) -> tuple[int, list[int]]:
    L, h = model.cfg.depth, model.cfg.num_heads
    if not -L <= opts.layer < L:
        raise ConfigError(f"layer {opts.layer} out of range: the model has {L} layers (0..{L - 1}, or negative)")
    if opts.head is not None and not 0 <= opts.head < h:
        raise ConfigError(f"head {opts.head} out of range: the model has {h} heads (0..{h - 1})")
    return opts.layer % L, list(range(h)) if opts.head is None else [opts.head]


@torch.inference_mode()
def attention_analysis(
    model: VisionTransformer,
    batches: Sequence[torch.Tensor] | Any,
    opts: AnalyzeOptions = AnalyzeOptions(),
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: bool = True,
) -> AttentionResult:
    """Mean attention distance over all images in ``batches`` (each (B, C, H, W)), plus rollout and raw
    attention maps of the first ``opts.max_overlays`` images, upsampled to the input size."""
    layer, heads = _check_layer_head(model, opts)
    model = model.eval().to(device)
    prefix, stride, cls = model.cfg.num_prefix_tokens, model.cfg.stride, bool(model.cfg.class_token)
    dist_sum: torch.Tensor | None = None
    count = 0
    rollouts: list[torch.Tensor] = []
    layer_maps: list[torch.Tensor] = []
    distances: torch.Tensor | None = None
    for x in tqdm(batches, desc="analyze", total=total, unit="batch", file=sys.stderr, disable=not progress):
        x = x.to(device)
        grid = model.grid_of(x)
        if distances is None:
            distances = distance_matrix(grid, stride, x.device)
        attns = model.forward_intermediates(x).attentions  # L x (B, h, T, T)
        per_layer = torch.stack(
            [mean_attention_distance(a, grid, stride, prefix, opts.renormalize, distances) for a in attns], dim=1
        )  # (B, L, h)
        dist_sum = per_layer.sum(0) if dist_sum is None else dist_sum + per_layer.sum(0)
        count += x.shape[0]
        keep = max(0, opts.max_overlays - sum(len(r) for r in rollouts))
        if keep:
            size = (x.shape[-2], x.shape[-1])
            sel = [a[:keep] for a in attns]
            rollouts.append(upsample_maps(rollout_maps(sel, grid, prefix, cls), size).cpu())
            raw = attention_maps(sel[layer][:, heads], grid, prefix, cls)  # (n, heads, gh, gw)
            layer_maps.append(upsample_maps(raw, size).cpu())
    if dist_sum is None:
        raise ConfigError("no images to analyse attention on")
    return AttentionResult(
        mean_distance=(dist_sum / count).cpu().numpy(),
        rollout=torch.cat(rollouts).numpy(),
        layer_maps=torch.cat(layer_maps).numpy(),
        num_images=count,
    )


def display_image(img: Image.Image, preprocess: Preprocess) -> np.ndarray:
    """The image as the model sees it (resized, cropped), (H, W) or (H, W, 3) in [0, 1], for figures."""
    img = preprocess.resized(convert_image(img, "L" if preprocess.grayscale else "RGB"))
    return np.asarray(img, dtype=np.float32) / 255.0


REPORT_FILES = (
    "summary.json",
    "patch_embedding_pca.png",
    "position_embedding_similarity.png",
    "attention_distance.png",
    "attention_rollout.png",
)


def is_report_file(name: str) -> bool:
    """A file name :func:`analyze` writes."""
    return name in REPORT_FILES or re.fullmatch(r"attention_layer\d+\.png", name) is not None


def check_analysis_dir(out_dir: str | os.PathLike[str]) -> None:
    """Refuse a folder :func:`analyze` would refuse (a file, a read-only place, a folder holding files of
    something else): ``vitkit analyze`` asks this before loading anything."""
    check_report_dir(Path(out_dir), is_report_file, ("summary.json", "position_embedding"), "vitkit analysis")


def analyze(
    model: VisionTransformer,
    preprocess: Preprocess,
    images: Sequence[Image.Image],
    names: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    opts: AnalyzeOptions = AnalyzeOptions(),
    device: torch.device | str = "cpu",
    progress: bool = True,
    source: str | None = None,
) -> dict[str, Any]:
    """Run every analysis, write the PNGs and ``summary.json`` into ``out_dir``; return the summary.

    ``out_dir`` must be new, empty, or hold only an earlier analysis (other files are never overwritten).
    """
    out = Path(out_dir)
    check_analysis_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    layer, heads = _check_layer_head(model, opts)
    cfg = model.cfg
    summary: dict[str, Any] = {
        "checkpoint": source,
        "model": cfg.name,
        "image_size": list(preprocess.image_size),
        "grid": list(cfg.grid_size),
        "patch_stride_pixels": cfg.stride,
        "classifier": cfg.classifier,
        "pos_embed": cfg.pos_embed,
        "depth": cfg.depth,
        "num_heads": cfg.num_heads,
    }
    try:
        pca = patch_embedding_pca(model, opts.num_components)
        fig = plots.plot_patch_pca(pca.components, pca.explained_variance_ratio, out / "patch_embedding_pca.png")
        summary["patch_embedding_pca"] = {
            "figure": fig.name,
            "explained_variance_ratio": pca.explained_variance_ratio.tolist(),
        }
    except NotApplicable as e:
        summary["patch_embedding_pca"] = {"skipped": str(e)}

    try:
        pe, grid = position_embeddings(model)
        sim = position_similarity(pe, grid)
        kind = "learned" if cfg.pos_embed == "learned" else "fixed 2-D sin-cos"
        name = out / "position_embedding_similarity.png"
        fig = plots.plot_position_similarity(sim, name, f"Position embedding ({kind})")
        summary["position_embedding"] = {"figure": fig.name, "kind": cfg.pos_embed, **similarity_summary(sim)}
    except NotApplicable as e:
        summary["position_embedding"] = {"skipped": str(e)}

    if not images:
        summary["attention"] = {"skipped": "no images given"}
    else:
        summary.update(_attention_figures(model, preprocess, images, names, out, opts, layer, heads, device, progress))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _attention_figures(
    model: VisionTransformer,
    preprocess: Preprocess,
    images: Sequence[Image.Image],
    names: Sequence[str],
    out: Path,
    opts: AnalyzeOptions,
    layer: int,
    heads: list[int],
    device: torch.device | str,
    progress: bool,
) -> dict[str, Any]:
    bs = opts.batch_size
    for img, name in zip(images, names, strict=True):
        preprocess.check_size(img.width, img.height, name)  # before any compute (a line of pixels, centre crop)
    batches = (
        torch.stack([preprocess.to_tensor(images[j], names[j]) for j in range(i, min(i + bs, len(images)))])
        for i in range(0, len(images), bs)
    )
    res = attention_analysis(model, batches, opts, device, total=-(-len(images) // bs), progress=progress)
    n = len(res.rollout)
    shown = [display_image(img, preprocess) for img in images[:n]]
    stride = model.cfg.stride
    grid = model.cfg.grid_at(preprocess.image_size)
    uniform = float(distance_matrix(grid, stride).mean())  # what attention spread evenly would give
    dist_fig = plots.plot_attention_distance(
        res.mean_distance, out / "attention_distance.png", f"Mean attention distance ({res.num_images} images)", uniform
    )
    query = "class token" if model.cfg.class_token else "mean over patch tokens"
    roll_fig = plots.plot_rollout(shown, res.rollout, list(names[:n]), out / "attention_rollout.png", query)
    m = min(n, MAX_HEAD_MAP_ROWS)  # one panel per head and image: keep the figure a readable size
    maps_fig = plots.plot_attention_maps(
        shown[:m], res.layer_maps[:m], heads, layer, out / f"attention_layer{layer + 1}.png", query
    )
    return {
        "attention_distance": {
            "figure": dist_fig.name,
            "num_images": res.num_images,
            "units": "pixels of the model input",
            "class_token": "excluded (patch queries and patch keys only)",
            "prefix_tokens_excluded": model.cfg.num_prefix_tokens,
            "renormalized_over_patches": opts.renormalize,
            "uniform_attention_reference": round(uniform, 4),
            "per_layer_head": res.mean_distance.round(4).tolist(),
            "per_layer_mean": res.mean_distance.mean(axis=1).round(4).tolist(),
        },
        "attention_rollout": {
            "figure": roll_fig.name,
            "images": list(names[:n]),
            "source": "class-token row" if model.cfg.class_token else "mean over patch-token rows (no class token)",
        },
        "attention_maps": {
            "images": list(names[:m]),
            "figure": maps_fig.name,
            "layer": layer + 1,
            "heads": [j + 1 for j in heads],
            "numbering": "1-based",
        },
    }
