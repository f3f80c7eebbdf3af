"""Figures as PNG files, drawn with matplotlib's object API on the Agg canvas (no pyplot, no global state).

Each function takes plain numpy arrays (computed elsewhere) and a path, and returns the path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from vitkit.fileio import write_file_atomic

DPI = 100


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Render on Agg and write a PNG with a 256-colour palette (photo panels stay small on disk), by
    :func:`~vitkit.fileio.write_file_atomic` (a temporary file renamed into place; a link at ``path`` refused)."""
    p = Path(path)
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3])
    png = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    return write_file_atomic(p, lambda tmp: png.save(tmp, format="PNG", optimize=True))  # never through a link


def _unit(x: np.ndarray) -> np.ndarray:
    """Rescale to [0, 1] (constant arrays become 0.5)."""
    lo, hi = float(np.min(x)), float(np.max(x))
    return np.full_like(x, 0.5) if hi - lo < 1e-12 else (x - lo) / (hi - lo)


def _show_image(ax: Axes, img: np.ndarray) -> None:
    """Show an (H, W) grey or (H, W, 3) RGB image in [0, 1] without axes."""
    if img.ndim == 2:
        ax.imshow(img, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    else:
        ax.imshow(img, interpolation="nearest")
    ax.set_axis_off()


def plot_patch_pca(components: np.ndarray, ratios: np.ndarray, path: str | os.PathLike[str]) -> Path:
    """Principal components of the patch-embedding filters (n, C, P, P) as tiles (paper fig. 7 left).

    Each tile is rescaled to [0, 1] on its own; RGB for 3 channels, grey otherwise (first channel).
    """
    n, C = components.shape[0], components.shape[1]
    cols = min(n, 7)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(1.0 * cols, 1.1 * rows + 0.35))
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i < n:
            tile = components[i].transpose(1, 2, 0) if C == 3 else components[i][0]
            _show_image(ax, _unit(tile))
            ax.set_title(f"PC{i + 1} {ratios[i]:.1%}", fontsize=6, pad=2)
    fig.suptitle("Patch-embedding filters: principal components", fontsize=9)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.45 / (1.1 * rows + 0.35), wspace=0.1, hspace=0.3)
    return _save(fig, path)


def similarity_mosaic(sim: np.ndarray, gap: int = 1) -> np.ndarray:
    """(gh, gw, gh, gw) -> one image of gh x gw small grids separated by NaN gaps."""
    gh, gw = sim.shape[:2]
    out = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan)
    for r in range(gh):
        for c in range(gw):
            top, left = r * (gh + gap), c * (gw + gap)
            out[top : top + gh, left : left + gw] = sim[r, c]
    return out


def plot_position_similarity(sim: np.ndarray, path: str | os.PathLike[str], title: str = "") -> Path:
    """Cosine similarity of each patch's position embedding with all others (paper fig. 7 centre)."""
    gh, gw = sim.shape[:2]
    mosaic = similarity_mosaic(sim)
    side = 5.0
    aspect = mosaic.shape[1] / mosaic.shape[0]
    fig = Figure(figsize=(side * min(aspect, 2.0) + 1.0, side))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks([c * (gw + 1) + (gw - 1) / 2 for c in range(gw)], [str(c + 1) for c in range(gw)], fontsize=6)
    ax.set_yticks([r * (gh + 1) + (gh - 1) / 2 for r in range(gh)], [str(r + 1) for r in range(gh)], fontsize=6)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.set_title(title or "Position embedding similarity", fontsize=9)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="cosine similarity")
    fig.tight_layout()
    return _save(fig, path)


def plot_attention_distance(
    distance: np.ndarray, path: str | os.PathLike[str], title: str = "", uniform: float | None = None
) -> Path:
    """Mean attention distance (pixels) of every head against depth, (L, h) (paper fig. 7 right / fig. 11).

    ``uniform``: the value uniform attention over all patches would give, drawn as a dashed reference line.
    """
    L, h = distance.shape
    fig = Figure(figsize=(4.5, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["tab20" if h > 10 else "tab10"]
    for j in range(h):
        ax.scatter(np.arange(1, L + 1), distance[:, j], s=14, color=cmap(j % cmap.N), label=f"head {j + 1}")
    top = float(np.nanmax(distance))
    if uniform is not None:
        ax.axhline(uniform, color="grey", linestyle="--", linewidth=0.8, label="uniform attention")
        top = max(top, uniform)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xlim(0.5, L + 0.5)
    ax.set_ylim(0, max(1e-9, top) * 1.1)
    ax.set_xticks(range(1, L + 1))
    ax.set_title(title or "Mean attention distance", fontsize=9)
    if h <= 16:
        ax.legend(fontsize=5, ncol=3, loc="lower right", frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def _overlay(img: np.ndarray, heat: np.ndarray) -> np.ndarray:
    """Blend an image in [0, 1] (grey or RGB) with a [0, 1] heat map in the 'jet' colormap."""
    rgb = np.repeat(img[..., None], 3, axis=-1) if img.ndim == 2 else img
    jet = colormaps["jet"](heat)[..., :3]
    return np.clip(0.5 * rgb + 0.5 * jet, 0, 1)


def plot_rollout(
    images: Sequence[np.ndarray],
    maps: np.ndarray,
    names: Sequence[str],
    path: str | os.PathLike[str],
    query: str = "class token",
) -> Path:
    """Per image: the input, the rollout heat map over it, and the input masked by it (paper fig. 6)."""
    n = len(images)
    fig = Figure(figsize=(6.0, 2.0 * n + 0.3))
    fig.suptitle(f"Attention rollout ({query} -> pixels)", fontsize=9)
    for i, (img, heat) in enumerate(zip(images, maps, strict=True)):
        masked = img * heat if img.ndim == 2 else img * heat[..., None]
        panels = [(img, names[i]), (_overlay(img, heat), "rollout"), (masked, "input x rollout")]
        for j, (panel, label) in enumerate(panels):
            ax = fig.add_subplot(n, 3, 3 * i + j + 1)
            _show_image(ax, panel)
            ax.set_title(label[:28], fontsize=7)
    fig.tight_layout(pad=0.4, rect=(0, 0, 1, 1 - 0.3 / (2.0 * n + 0.3)))
    return _save(fig, path)


def plot_attention_maps(
    images: Sequence[np.ndarray],
    maps: np.ndarray,
    heads: Sequence[int],
    layer: int,
    path: str | os.PathLike[str],
    query: str = "class token",
) -> Path:
    """Raw attention of one layer, one column per head, one row per image: maps (n, heads, H, W) in [0, 1]."""
    n, nh = maps.shape[:2]
    cols = nh + 1
    fig = Figure(figsize=(1.3 * cols, 1.5 * n + 0.4))
    fig.suptitle(f"Layer {layer + 1} attention of the {query}, per head", fontsize=9)
    for i in range(n):
        ax = fig.add_subplot(n, cols, i * cols + 1)
        _show_image(ax, images[i])
        ax.set_title("input", fontsize=6)
        for j in range(nh):
            ax = fig.add_subplot(n, cols, i * cols + j + 2)
            _show_image(ax, _overlay(images[i], maps[i, j]))
            ax.set_title(f"head {heads[j] + 1}", fontsize=6)
    fig.tight_layout(pad=0.3, rect=(0, 0, 1, 1 - 0.35 / (1.5 * n + 0.4)))
    return _save(fig, path)


def plot_confusion(confusion: np.ndarray, class_names: Sequence[str], path: str | os.PathLike[str]) -> Path:
    """Confusion matrix (rows: true class, columns: predicted), normalised per row, counts written if small."""
    K = len(confusion)
    support = confusion.sum(axis=1, keepdims=True)
    norm = confusion / np.maximum(support, 1)
    side = min(12.0, max(4.0, 0.35 * K + 2))
    fig = Figure(figsize=(side + 1, side))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    if K <= 50:
        labels = [n if len(n) <= 14 else n[:13] + "…" for n in class_names]
        ax.set_xticks(range(K), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(K), labels, fontsize=7)
    if K <= 20:
        for r in range(K):
            for c in range(K):
                if confusion[r, c]:
                    color = "white" if norm[r, c] > 0.5 else "black"
                    ax.text(c, r, str(confusion[r, c]), ha="center", va="center", fontsize=7, color=color)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title("Confusion matrix (row-normalised)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return _save(fig, path)
