"""``vitkit analyze``: the paper's figures 6, 7 and 11 for any checkpoint, as PNGs plus a JSON summary.

Weight-only analyses (patch-embedding PCA, position-embedding similarity) need no images; the attention
analyses (mean attention distance, rollout, raw maps) run the model's attention path over the given images in
batches that the job runner decodes and feeds (:class:`~vitkit.inference.features.FeatureProvider`, the
evaluators' one provider, with their :class:`~vitkit.inference.features.ExtractOptions`), on any device.
"""

from __future__ import annotations

import dataclasses
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
from vitkit.analysis.attention_maps import (
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
from vitkit.data.stream import ImageSource, StreamBatch
from vitkit.errors import ConfigError
from vitkit.fileio import write_text_atomic
from vitkit.images import LazyImage, convert_image, load_image, open_lazy
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import EXTRACT_DEFAULTS, ExtractOptions, FeatureProvider
from vitkit.models.vit import VisionTransformer
from vitkit.output_paths import check_report_dir

MAX_HEAD_MAP_ROWS = 4


@dataclass(frozen=True)
class AnalyzeOptions:
    """What to compute and draw."""

    layer: int = -1  # layer of the raw attention maps, 0-based (negative: from the end)
    head: int | None = None  # head of the raw attention maps, 0-based (None: all heads)
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


class _AttentionSums:
    """The attention analyses accumulated batch by batch: the per-image mean distances summed, the rollout and
    raw maps of the first ``opts.max_overlays`` images kept."""

    def __init__(self, model: VisionTransformer, opts: AnalyzeOptions) -> None:
        self.layer, self.heads = _check_layer_head(model, opts)
        self.opts, self.cfg = opts, model.cfg
        self.dist_sum: torch.Tensor | None = None
        self.count = 0
        self.rollouts: list[torch.Tensor] = []
        self.layer_maps: list[torch.Tensor] = []
        self.distances: torch.Tensor | None = None

    def add(self, x: torch.Tensor, grid: tuple[int, int], attns: Sequence[torch.Tensor]) -> int:
        """One batch ``x`` (B, C, H, W) and its blocks' attention probabilities; returns how many of its first
        images are kept for the figures."""
        prefix, stride, cls = self.cfg.num_prefix_tokens, self.cfg.stride, bool(self.cfg.class_token)
        if self.distances is None:
            self.distances = distance_matrix(grid, stride, x.device)
        per_layer = torch.stack(
            [mean_attention_distance(a, grid, stride, prefix, self.opts.renormalize, self.distances) for a in attns],
            dim=1,
        )  # (B, L, h)
        self.dist_sum = per_layer.sum(0) if self.dist_sum is None else self.dist_sum + per_layer.sum(0)
        self.count += x.shape[0]
        keep = max(0, self.opts.max_overlays - sum(len(r) for r in self.rollouts))
        if keep:
            size = (x.shape[-2], x.shape[-1])
            sel = [a[:keep] for a in attns]
            self.rollouts.append(upsample_maps(rollout_maps(sel, grid, prefix, cls), size).cpu())
            raw = attention_maps(sel[self.layer][:, self.heads], grid, prefix, cls)  # (n, heads, gh, gw)
            self.layer_maps.append(upsample_maps(raw, size).cpu())
        return min(keep, x.shape[0])

    def result(self) -> AttentionResult:
        if self.dist_sum is None:
            raise ConfigError("no images to analyse attention on")
        return AttentionResult(
            mean_distance=(self.dist_sum / self.count).cpu().numpy(),
            rollout=torch.cat(self.rollouts).numpy(),
            layer_maps=torch.cat(self.layer_maps).numpy(),
            num_images=self.count,
        )


@torch.inference_mode()
def attention_analysis(
    model: VisionTransformer,
    batches: Sequence[torch.Tensor] | Any,
    opts: AnalyzeOptions = AnalyzeOptions(),
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: bool = True,
) -> AttentionResult:
    """Mean attention distance over all images in ``batches`` (each (B, C, H, W), preprocessed), plus rollout and
    raw attention maps of the first ``opts.max_overlays`` images, upsampled to the input size. (:func:`analyze`
    runs the same sums over the job runner's batches.)"""
    sums = _AttentionSums(model, opts)
    model = model.eval().to(device)
    for x in tqdm(batches, desc="analyze", total=total, unit="batch", file=sys.stderr, disable=not progress):
        x = x.to(device)
        sums.add(x, model.grid_of(x), model.forward_intermediates(x).attentions)  # L x (B, h, T, T)
    return sums.result()


class AnalysisImages(ImageSource):
    """The images of an analysis, as a job's source: image files or PIL images (``images``, named by
    ``names``, default a file's base name), then a dataset's examples at ``positions`` (named ``split[i]
    class``), in that order."""

    def __init__(
        self,
        images: Sequence[str | os.PathLike[str] | Image.Image] = (),
        names: Sequence[str] | None = None,
        dataset: Any = None,
        positions: Sequence[int] = (),
    ) -> None:
        self.images = [img if isinstance(img, Image.Image) else os.fspath(img) for img in images]
        given = [img if isinstance(img, str) else f"image {i}" for i, img in enumerate(self.images)]
        self.names = list(names) if names is not None else [os.path.basename(n) for n in given]
        if len(self.names) != len(self.images):
            raise ConfigError(f"{len(self.images)} images but {len(self.names)} names")
        self.ids = given
        self.dataset, self.positions = dataset, list(positions)

    def __len__(self) -> int:
        return len(self.images) + len(self.positions)

    def item_id(self, index: int) -> str:
        if index < len(self.images):
            return self.ids[index]
        pos = self.positions[index - len(self.images)]
        describe = getattr(self.dataset, "describe", None)
        return str(describe(pos)) if describe is not None else str(pos)

    def load(self, index: int, lazy: bool) -> tuple[LazyImage, int]:
        if index < len(self.images):
            img = self.images[index]
            if isinstance(img, Image.Image):
                return img, -1
            return (open_lazy(img) if lazy else load_image(img)), -1
        pos = self.positions[index - len(self.images)]
        ds = self.dataset
        img, label = ds.lazy_item(pos) if lazy and hasattr(ds, "lazy_item") else ds[pos]
        return img, int(label)

    def name(self, index: int, label: int) -> str:
        """What the figures call image ``index`` (of label ``label``)."""
        if index < len(self.images):
            return self.names[index]
        classes = list(self.dataset.classes)
        split = getattr(self.dataset, "split", "")
        pos = self.positions[index - len(self.images)]
        return f"{split}[{pos}] {classes[label] if 0 <= label < len(classes) else label}"


def dataset_positions(dataset: Any, n: int) -> list[int]:
    """``n`` positions spread evenly over a map-style dataset (all of a smaller one)."""
    return np.unique(np.linspace(0, len(dataset) - 1, num=min(n, len(dataset))).round().astype(int)).tolist()


def display_image(img: Image.Image, preprocess: Preprocess) -> np.ndarray:
    """The image as the model sees it (resized, cropped), (H, W) or (H, W, 3) in [0, 1], for figures."""
    img = preprocess.resized(convert_image(img, "L" if preprocess.grayscale else "RGB"))
    return np.asarray(img, dtype=np.float32) / 255.0


def displayed(x: torch.Tensor, preprocess: Preprocess) -> np.ndarray:
    """A model input (C, H, W), normalised, back to the pixels it was made from: (H, W) or (H, W, 3) in [0, 1]
    (:func:`display_image` of the image, up to float rounding), for figures."""
    c = x.shape[0]
    mean = torch.tensor(preprocess.mean[:c], dtype=torch.float32).view(c, 1, 1)
    std = torch.tensor(preprocess.std[:c], dtype=torch.float32).view(c, 1, 1)
    pixels = (x.float().cpu() * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()
    return pixels[..., 0] if pixels.shape[-1] == 1 else pixels


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
    images: Sequence[str | os.PathLike[str] | Image.Image] | AnalysisImages,
    names: Sequence[str] | None,
    out_dir: str | os.PathLike[str],
    *,
    opts: AnalyzeOptions = AnalyzeOptions(),
    run: ExtractOptions = EXTRACT_DEFAULTS,
    source: str | None = None,
) -> dict[str, Any]:
    """Run every analysis, write the PNGs and ``summary.json`` into ``out_dir``; return the summary.

    ``images``: image files or PIL images (named by ``names``; None: a file's base name), or an
    :class:`AnalysisImages` (files, then a dataset's examples). They are decoded, batched and fed by the job
    runner with ``run`` (:class:`~vitkit.inference.features.ExtractOptions`: batch size, workers, device,
    ``skip_bad``, progress; the attention is the fp32 model's), before anything is written: a bad image stops the
    analysis with nothing written. ``out_dir`` must be new, empty, or hold only an earlier analysis (other files
    are never overwritten).
    """
    out = Path(out_dir)
    check_analysis_dir(out)
    layer, heads = _check_layer_head(model, opts)
    pictures = images if isinstance(images, AnalysisImages) else AnalysisImages(images, names)
    attention = _attend(model, preprocess, pictures, opts, run) if len(pictures) else None
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    summary: dict[str, Any] = {
        "checkpoint": source,
        "model": cfg.name,
        "image_size": list(preprocess.image_size),
        "grid": list(cfg.grid_size),
        "patch_stride_pixels": cfg.stride,
        **{key: getattr(cfg, key) for key in ("classifier", "pos_embed", "depth", "num_heads")},
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

    if attention is None:
        summary["attention"] = {"skipped": "no images given"}
    else:
        summary.update(_attention_figures(model, preprocess, *attention, out, opts, layer, heads))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _attend(
    model: VisionTransformer, preprocess: Preprocess, pictures: AnalysisImages, opts: AnalyzeOptions,
    run: ExtractOptions,
) -> tuple[AttentionResult, list[np.ndarray], list[str], list[str]]:  # fmt: skip
    """The attention analyses over the runner's batches of ``pictures`` on the fp32 model: the result, the first
    images as the model saw them, their names, and notes (images left out with ``skip_bad``)."""
    sums = _AttentionSums(model, opts)
    shown: list[np.ndarray] = []
    shown_names: list[str] = []

    @torch.inference_mode()
    def attend(engine: InferenceEngine, b: StreamBatch) -> dict[str, np.ndarray]:
        ok = b.ok
        if ok.any():
            x = engine.prepare(b.images)
            kept = sums.add(x, model.grid_of(x), engine.attentions(x).attentions)
            shown.extend(displayed(img, preprocess) for img in x[:kept])
            shown_names.extend(
                pictures.name(int(p), int(lab))
                for p, lab in zip(b.positions[ok][:kept], b.labels[ok][:kept], strict=True)
            )
        return {"failed": b.positions[~ok]}

    fp32 = dataclasses.replace(run, precision="fp32", backend="torch", decode="cpu", dist=None)
    cols, summary = FeatureProvider(model, preprocess, fp32).run(pictures, attend, desc="analyze")
    failed = len(cols.get("failed", ()))
    notes = [f"analyze: {failed} image(s) did not decode and are left out (first: {summary.first_failure})"]
    return sums.result(), shown, shown_names, notes if failed else []


def _attention_figures(
    model: VisionTransformer,
    preprocess: Preprocess,
    res: AttentionResult,
    shown: list[np.ndarray],
    names: list[str],
    notes: list[str],
    out: Path,
    opts: AnalyzeOptions,
    layer: int,
    heads: list[int],
) -> dict[str, Any]:
    n = len(res.rollout)
    stride = model.cfg.stride
    grid = model.cfg.grid_at(preprocess.image_size)
    uniform = float(distance_matrix(grid, stride).mean())  # what attention spread evenly would give
    dist_fig = plots.plot_attention_distance(
        res.mean_distance, out / "attention_distance.png", f"Mean attention distance ({res.num_images} images)", uniform
    )
    query = "class token" if model.cfg.class_token else "mean over patch tokens"
    roll_fig = plots.plot_rollout(shown, res.rollout, names[:n], out / "attention_rollout.png", query)
    m = min(n, MAX_HEAD_MAP_ROWS)  # one panel per head and image: keep the figure a readable size
    maps_fig = plots.plot_attention_maps(
        shown[:m], res.layer_maps[:m], heads, layer, out / f"attention_layer{layer + 1}.png", query
    )
    return {
        "attention_distance": {
            "figure": dist_fig.name,
            "num_images": res.num_images,
            **({"notes": notes} if notes else {}),
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
            "images": names[:n],
            "source": "class-token row" if model.cfg.class_token else "mean over patch-token rows (no class token)",
        },
        "attention_maps": {
            "images": names[:m],
            "figure": maps_fig.name,
            "layer": layer + 1,
            "heads": [j + 1 for j in heads],
            "numbering": "1-based",
        },
    }
