"""``vitkit demo``: a Gradio page that shows what a checkpoint predicts and what it attends to.

Upload, paste or pick a sample image; the page shows the top-5 classes as bars, the attention rollout
overlaid on the image as the model sees it, one layer's raw attention (a head, or the mean of the heads),
and the model's own figures: position-embedding similarity and the principal components of the
patch-embedding filters (paper fig. 7). Uploads are decoded by vitkit's decoder (a file that is not an image
is one line on the page and in the log), and predictions and attention come from the checkpoint's fp32 model
(``forward_intermediates``), so the labels are those of ``vitkit predict``.

With an index (``vitkit demo CKPT --index INDEX``, made by the same checkpoint) a "Similar images" tab shows an
uploaded image, or an indexed one picked by id, and its nearest indexed images as thumbnails with their ids and
scores: those of ``vitkit search``. The thumbnails are :meth:`SimilarImages.thumbnail`'s, written into the page's
own folder; the indexed folder is never handed to Gradio, so nothing else on disk is served.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from PIL import Image

from vitkit.analysis import plots
from vitkit.analysis.analyze import display_image
from vitkit.analysis.attention_maps import rollout_maps, upsample_maps
from vitkit.analysis.embeddings import NotApplicable, patch_embedding_pca, position_embeddings, position_similarity
from vitkit.errors import ConfigError, DataError
from vitkit.fileio import write_file_atomic
from vitkit.images import convert_image, decode_image
from vitkit.serve.net import check_free
from vitkit.serve.served_model import ServedModel
from vitkit.serve.similar import THUMBNAIL_PX, SimilarImages

logger = logging.getLogger(__name__)

DISPLAY_PX = 336  # overlays are shown at least this large (nearest-neighbour upscaling of the model input)
MEAN_OF_HEADS = "mean of heads"


def overlay(img: np.ndarray, heat: np.ndarray) -> Image.Image:
    """An image (H, W[, 3]) in [0, 1] blended with a [0, 1] heat map in 'jet', upscaled for display."""
    rgb = np.repeat(img[..., None], 3, axis=-1) if img.ndim == 2 else img
    blend = np.clip(0.5 * rgb + 0.5 * colormaps["jet"](heat)[..., :3], 0, 1)
    out = Image.fromarray(np.round(blend * 255).astype(np.uint8))
    scale = max(1, -(-DISPLAY_PX // max(out.size)))
    return out.resize((out.width * scale, out.height * scale), Image.Resampling.NEAREST)


# the weight-only figures on the page: model_figures' key, the figure's label, its name where it is not shown
FIGURES = (
    ("position", "Position-embedding similarity", "Position-embedding similarity"),
    ("filters", "Patch-embedding filters (PCA)", "Patch-embedding filters"),
)


def model_figures(served: ServedModel, out_dir: Path) -> dict[str, Path | str]:
    """The weight-only figures of the model as PNGs in ``out_dir`` (a message where one does not apply)."""
    model = served.model
    figs: dict[str, Path | str] = {}
    try:
        pe, grid = position_embeddings(model)
        kind = "learned" if model.cfg.pos_embed == "learned" else "fixed 2-D sin-cos"
        figs["position"] = plots.plot_position_similarity(
            position_similarity(pe, grid), out_dir / "position_embedding_similarity.png", f"Position embedding ({kind})"
        )
    except NotApplicable as e:  # RoPE models
        figs["position"] = str(e)
    try:
        pca = patch_embedding_pca(model, 28)
        figs["filters"] = plots.plot_patch_pca(
            pca.components, pca.explained_variance_ratio, out_dir / "patch_embedding_pca.png"
        )
    except NotApplicable as e:
        figs["filters"] = str(e)
    return figs


class DemoModel:
    """The computations behind the page, independent of Gradio (tested directly)."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        cfg = served.model.cfg
        self.depth, self.num_heads, self.prefix = cfg.depth, cfg.num_heads, cfg.num_prefix_tokens
        self.class_token = bool(cfg.class_token)  # registers are prefix tokens too: not the query

    def analyse(self, img: Image.Image) -> dict[str, Any]:
        """Top classes, rollout overlay and everything needed to draw raw attention maps later."""
        x = self.served.to_tensor(img)[None]  # (1, C, H, W)
        attns, logits, grid = self.served.attentions(x)
        probs = logits.softmax(dim=-1)[0]
        top = self.served.top_k(probs, 5)  # fewer with fewer classes
        size = (x.shape[-2], x.shape[-1])
        shown = display_image(img, self.served.preprocess)
        roll = upsample_maps(rollout_maps(attns, grid, self.prefix, self.class_token), size)[0].numpy()
        return {
            "labels": {t["label"]: t["prob"] for t in top},
            "top": top,
            "rollout": overlay(shown, roll),
            "attentions": [a.cpu() for a in attns],
            "grid": grid,
            "size": size,
            "shown": shown,
        }

    def upload_view(self, upload: dict[str, Any] | None, layer: int, head: str) -> tuple[Any, Any, Any, Any, str]:
        """The page's answer to an upload (Gradio's file record: ``path``, ``orig_name``): the top-5, the rollout
        overlay, the chosen layer's map, the state for later layer/head changes, and the verdict line. A file
        that does not decode (not an image, truncated, too large) is answered by one verdict line naming it and
        one warning on the ``vitkit.serve.demo`` logger."""
        if not upload or not upload.get("path"):
            return None, None, None, None, ""
        name = upload.get("orig_name") or Path(upload["path"]).name
        try:
            state = self.analyse(decode_image(upload["path"], name))
        except DataError as e:
            logger.warning("vitkit demo: upload refused: %s", e)
            return None, None, None, None, f"**Cannot classify this upload:** {e}"
        best = state["top"][0]
        line = f"**Prediction: {best['label']}** ({best['prob']:.1%})"
        return state["labels"], state["rollout"], self.layer_view(state, layer, head), state, line

    def layer_view(self, state: dict[str, Any] | None, layer: int, head: str) -> Image.Image | None:
        """Layer ``layer`` (1-based) attention of the class token (GAP: mean query) for one head or their mean."""
        if not state:
            return None
        layer = min(max(int(layer), 1), self.depth) - 1
        maps = self.served.layer_maps(state["attentions"], state["grid"], layer, state["size"])[0]  # (h, H, W)
        if head == MEAN_OF_HEADS:
            heat = maps.mean(axis=0)
            lo, hi = heat.min(), heat.max()
            heat = (heat - lo) / max(hi - lo, 1e-12)
        else:
            heat = maps[int(head.split()[-1]) - 1]
        return overlay(state["shown"], heat)


class SimilarView:
    """The "Similar images" tab's computations, independent of Gradio (tested directly): a query (an upload or an
    indexed id) -> its vector, and a vector -> the neighbours' thumbnails, captions and table."""

    def __init__(self, served: ServedModel, similar: SimilarImages, work_dir: Path) -> None:
        self.served, self.similar = served, similar
        self.thumbs = work_dir / "thumbnails"
        self.thumbs.mkdir(parents=True, exist_ok=True)

    def thumbnail_file(self, id: str) -> str | None:
        """The thumbnail of the indexed image ``id`` as a JPEG in the page's folder; None when it is not served."""
        path = self.thumbs / f"{hashlib.sha256(id.encode()).hexdigest()[:32]}.jpg"
        if not path.exists():
            try:  # vitkit's decoder, a JPEG at reduced scale
                data = self.similar.thumbnail(id, lambda d, px: decode_image(d, "indexed image", draft=(px, px)))
            except DataError as e:
                logger.warning("vitkit demo: no thumbnail for %s: %s", id, e)
                return None
            write_file_atomic(path, lambda tmp: tmp.write_bytes(data))
        return str(path)

    def query(self, upload: dict[str, Any] | None, id: str | None) -> tuple[Any, Any, str]:
        """(query picture, state ``(vector, id)``, verdict) of an upload (Gradio's file record) or an indexed id;
        a file that does not decode or an unknown id is one verdict line."""
        if id:
            try:
                vector = np.asarray(self.similar.index.vector(id))
            except DataError:
                return None, None, f"**Not in the index:** {id}"
            return self.thumbnail_file(id), (vector, id), f"**Query:** indexed image `{id}`"
        if not upload or not upload.get("path"):
            return None, None, ""
        name = upload.get("orig_name") or Path(upload["path"]).name
        try:
            img = decode_image(upload["path"], name)
        except DataError as e:
            logger.warning("vitkit demo: upload refused: %s", e)
            return None, None, f"**Cannot search with this upload:** {e}"
        vector = self.similar.vectors(self.served, self.served.to_tensor(img)[None])[0]
        shown = convert_image(img, "RGB")
        shown.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX), Image.Resampling.BICUBIC)
        return shown, (vector, None), f"**Query:** {name}"

    def neighbours(self, state: tuple[np.ndarray, str | None] | None, k: int) -> tuple[list[tuple[str, str]], str]:
        """The gallery (thumbnail, caption) and the table (rank, id, score) of the query's ``k`` neighbours."""
        if state is None:
            return [], ""
        vector, skip = state
        hits = self.similar.neighbours(vector, int(k), skip=skip)
        gallery = [(self.thumbnail_file(h["id"]) or self._placeholder(), f"{h['score']:.4f} · {Path(h['id']).name}")
                   for h in hits]  # fmt: skip
        rows = "".join(f"| {i} | `{h['id']}` | {h['score']:.6f} |\n" for i, h in enumerate(hits, 1))
        return gallery, f"| rank | id | score |\n|---|---|---|\n{rows}"

    def _placeholder(self) -> str:
        path = self.thumbs / "missing.png"
        if not path.exists():
            grey = Image.new("RGB", (32, 32), (200, 200, 200))
            write_file_atomic(path, lambda tmp: grey.save(tmp, format="PNG"))
        return str(path)


def default_samples(out_dir: Path) -> list[Path]:
    """Sample images written into ``out_dir``: scikit-learn's two photos and three bundled 8x8 digits."""
    from sklearn.datasets import load_digits, load_sample_image

    paths = []
    for name in ("china.jpg", "flower.jpg"):
        photo = Image.fromarray(load_sample_image(name))
        paths.append(write_file_atomic(out_dir / name, lambda tmp: photo.save(tmp, quality=90)))  # noqa: B023
    digits = load_digits()
    for label in (0, 3, 7):
        i = int(np.flatnonzero(digits.target == label)[-1])
        arr = np.round(digits.images[i] / 16.0 * 255).astype(np.uint8)
        digit = Image.fromarray(arr, mode="L").resize((64, 64), Image.Resampling.NEAREST)
        paths.append(write_file_atomic(out_dir / f"digit_{label}.png", lambda tmp: digit.save(tmp)))  # noqa: B023
    return paths


def build_demo(
    served: ServedModel, work_dir: Path, samples: Sequence[Path] = (), similar: SimilarImages | None = None
) -> Any:
    """The Gradio Blocks page for ``served``; figures, samples and thumbnails are written into ``work_dir``. With
    ``similar`` (an index the checkpoint made) the page has a "Similar images" tab."""
    import gradio as gr

    demo_model = DemoModel(served)
    card = served.card()
    figs = model_figures(served, work_dir)
    examples = [[str(p)] for p in [*default_samples(work_dir), *samples]]
    head_choices = [MEAN_OF_HEADS] + [f"head {i + 1}" for i in range(demo_model.num_heads)]
    query = "class token" if demo_model.class_token else "mean over the patch tokens (no class token)"
    H, W = card["image_size"]
    with gr.Blocks(title=f"vitkit demo: {card['name']}", analytics_enabled=False) as demo:
        gr.Markdown(
            f"# vitkit demo: {card['name']}\n"
            f"`{card['checkpoint']}` ({card['format']}) · {card['num_classes']} classes · input {H}x{W} px · "
            f"patch {card['patch_size']} · {card['depth']} layers x {card['num_heads']} heads · "
            f"classifier: {card['classifier']}"
        )
        with gr.Tabs() if similar is not None else nullcontext():
            with gr.Tab("Predictions", id="predictions") if similar is not None else nullcontext():
                _prediction_tab(gr, demo_model, examples, head_choices, query, figs)
            if similar is not None:
                with gr.Tab("Similar images", id="similar", elem_id="similar-tab"):
                    _similar_tab(gr, SimilarView(served, similar, work_dir), len(similar.index))
    return demo


def _prediction_tab(gr: Any, demo_model: DemoModel, examples: list[list[str]], head_choices: list[str], query: str,
                    figs: dict[str, Path | str]) -> None:  # fmt: skip
    """The predictions: the upload, the top-5, the rollout, one layer's attention, the model's figures."""

    def on_image(upload: dict[str, Any] | None, layer: int, head: str) -> tuple[Any, Any, Any, Any, str]:
        return demo_model.upload_view(upload, layer, head)

    state = gr.State(None)
    with gr.Row():
        with gr.Column():
            image = gr.Image(
                sources=["upload", "clipboard"], label="Image: upload, paste, or pick a sample",
                elem_id="input-image",
            )  # fmt: skip
            gr.Examples(examples=examples, inputs=image, label="Samples")
        with gr.Column():
            verdict = gr.Markdown(elem_id="verdict")
            top5 = gr.Label(num_top_classes=5, label="Top-5", elem_id="top5")
        with gr.Column():
            rollout = gr.Image(
                label=f"Attention rollout ({query} -> pixels)", interactive=False, elem_id="rollout",
                format="png",
            )  # fmt: skip
    with gr.Row():
        with gr.Column(scale=1):
            layer = gr.Slider(1, demo_model.depth, value=demo_model.depth, step=1, label="Layer")
            head = gr.Dropdown(head_choices, value=MEAN_OF_HEADS, label="Head")
        with gr.Column(scale=2):
            raw = gr.Image(
                label=f"Raw attention of the {query}", interactive=False, elem_id="raw-attention", format="png"
            )
    with gr.Row():  # no label badge over the figures: it covered their titles, which say what they show
        for key, label, name in FIGURES:
            if isinstance(figs[key], Path):
                gr.Image(
                    value=str(figs[key]), label=label, interactive=False, show_label=False, elem_id=f"{key}-figure"
                )
            else:  # where a figure does not apply (RoPE: no position embedding), why, not an image of the message
                gr.Markdown(f"{name}: not shown ({figs[key]}).")
    # preprocess=False: the upload arrives as Gradio's file record and is decoded by vitkit's decoder, so a
    # file that is not an image is one line on the page and in the log rather than Gradio's traceback
    image.change(on_image, [image, layer, head], [top5, rollout, raw, state, verdict], preprocess=False)
    layer.change(demo_model.layer_view, [state, layer, head], raw)
    head.change(demo_model.layer_view, [state, layer, head], raw)


def _similar_tab(gr: Any, view: SimilarView, count: int) -> None:
    """Upload an image or pick an indexed id; the query and its nearest indexed images, with ids and scores."""
    state = gr.State(None)
    with gr.Row():
        with gr.Column(scale=1):
            upload = gr.Image(sources=["upload", "clipboard"], label="Image to search with: upload or paste",
                              elem_id="similar-input")  # fmt: skip
            ids = view.similar.index.ids
            pick = gr.Dropdown(list(ids[:1000]), value=None, label=f"or an indexed image ({count} indexed)",
                               allow_custom_value=True, filterable=True, elem_id="similar-id")  # fmt: skip
            k = gr.Slider(1, min(50, max(1, count)), value=min(8, count), step=1, label="Neighbours",
                          elem_id="similar-k")  # fmt: skip
        with gr.Column(scale=1):
            verdict = gr.Markdown(elem_id="similar-verdict")
            shown = gr.Image(label="Query", interactive=False, elem_id="similar-query", format="jpeg")
    gallery = gr.Gallery(label="Most similar indexed images", columns=4, object_fit="contain",
                         elem_id="neighbours", format="jpeg")  # fmt: skip
    table = gr.Markdown(elem_id="neighbour-table")

    def by_upload(file: dict[str, Any] | None, k: int) -> tuple[Any, Any, str, Any, str]:
        picture, st, line = view.query(file, None)
        return (picture, st, line, *view.neighbours(st, k))

    def by_id(id: str | None, k: int) -> tuple[Any, Any, str, Any, str]:
        picture, st, line = view.query(None, id)
        return (picture, st, line, *view.neighbours(st, k))

    outputs = [shown, state, verdict, gallery, table]
    upload.change(by_upload, [upload, k], outputs, preprocess=False)  # vitkit's decoder, as the predictions tab
    pick.input(by_id, [pick, k], outputs)
    k.release(view.neighbours, [state, k], [gallery, table])


def launch(demo: Any, host: str, port: int, allowed: Sequence[str | os.PathLike[str]]) -> None:
    """Serve the page (blocks until Ctrl-C); no share
    link, no analytics, no external fonts, and none of Gradio's own banner (its "Running on local URL" and "set
    `share=True` in `launch()`", an option ``vitkit demo`` does not have): the command prints its address."""
    import gradio as gr

    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace"])
    torch.set_grad_enabled(False)
    check_free(host, port)  # taken since the command checked it: one line naming --port, not Gradio's advice
    try:
        demo.launch(
            server_name=host,
            server_port=port,
            share=False,
            ssr_mode=False,
            allowed_paths=[str(p) for p in allowed],
            theme=theme,
            show_error=True,
            quiet=True,
        )
    except OSError as e:
        if "port" not in str(e).lower():
            raise
        raise ConfigError(
            f"--port {port}: {host}:{port} is already in use by another program; choose another --port"
        ) from None
