"""The model behind ``vitkit serve`` and ``vitkit demo``: a checkpoint on the inference engine, and the
attention analyses for single images.

Predictions run through :class:`vitkit.inference.engine.InferenceEngine` (the engine every batch job uses:
the fast path in bf16 or int8, the fp32 reference, or ONNX Runtime / OpenVINO). Attention maps need the
attention probabilities, which the fast path never materialises, so they come from the checkpoint's own fp32
model (the engine's ``attentions``: ``forward_intermediates``), run only for the images that ask for them.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitkit.analysis.attention_maps import attention_maps, rollout_maps, upsample_maps
from vitkit.checkpoints import Loaded, load_checkpoint
from vitkit.errors import ConfigError, VitkitError
from vitkit.inference.engine import (  # re-exported: the serve command and its tests name them here
    InferenceEngine,
    calibration_batch,
    check_calibration_used,
    uses_calibration,
)
from vitkit.inference.policy import plan_engine, resolve_precision

__all__ = [
    "Answer",
    "RequestError",
    "ServedModel",
    "calibration_batch",
    "check_calibration_used",
    "png_base64",
    "resolve_precision",
    "uses_calibration",
]


class RequestError(VitkitError):
    """Bad input from a client: answered with ``status`` and the message, never a server error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def png_base64(gray: np.ndarray) -> str:
    """A map in [0, 1], (H, W), as a base64-encoded 8-bit greyscale PNG."""
    buf = io.BytesIO()
    Image.fromarray(np.round(np.clip(gray, 0, 1) * 255).astype(np.uint8), mode="L").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass(frozen=True)
class Answer:
    """One image's answer: class probabilities (K,) and, when asked for, the rollout map (H, W) in [0, 1] and the
    image's vector for a similar-images search (D,)."""

    probs: torch.Tensor
    rollout: np.ndarray | None = None
    vector: np.ndarray | None = None


class ServedModel:
    """A loaded checkpoint ready to answer: ``predict`` (the inference engine) and ``attention`` (fp32 model).

    ``precision``: ``auto``, ``fp32``, ``bf16`` or ``int8`` (see :func:`resolve_precision`); ``max_batch``
    chooses oneDNN's weight layout for the batches the server will run (any batch works). ``fast=False``
    predicts with the checkpoint's own fp32 model (no second copy of the weights; the demo's choice), as
    ``precision="fp32"`` does. ``backend``: ``torch`` (vitkit's fast path), ``onnxruntime``, ``openvino`` or
    ``auto`` (the fastest of them here, measured at start-up); ONNX Runtime computes in fp32 or int8, so ``auto``
    precision means fp32 there. OpenVINO's int8 is calibrated on ``calibration`` (image files: see
    :func:`calibration_batch`), else on the preprocessed sample photos and digits of ``vitkit.bench.sample_images``;
    ``calibration`` with any other backend or precision is refused (ConfigError), as it would not be used.
    """

    def __init__(
        self,
        loaded: Loaded,
        precision: str = "auto",
        max_batch: int = 8,
        device: torch.device | str = "cpu",
        fast: bool = True,
        backend: str = "torch",
        calibration: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        self.loaded = loaded
        if loaded.model.cfg.num_classes <= 0:
            raise ConfigError(f"{loaded.meta.source}: the model has no classification head; nothing to serve")
        if backend != "torch" and not fast:
            raise ConfigError(f"--backend {backend}: the engines run the fast path, on the CPU")
        # the plan, once: where it runs (the engines: the CPU, policy.engine_device), the precision auto resolves to
        plan = plan_engine(precision if fast else "fp32", backend, device, batch_size=max_batch)
        if calibration is not None:  # without the fast path the precision is fp32: nothing calibrates
            check_calibration_used(backend, plan.precision)
        pre = loaded.meta.preprocess

        def calibrate() -> torch.Tensor:
            if calibration is not None:
                return calibration_batch(calibration, pre)
            from vitkit.bench.sample_images import real_image_batch

            return real_image_batch(pre, digits=8)  # NNCF: 24 photos and 8 digits

        self.engine = InferenceEngine.from_loaded(loaded, plan=plan, batch_size=max_batch, calibration=calibrate)
        self.device = self.engine.device
        self.model = self.engine.model
        self.preprocess = pre
        self.precision = self.engine.precision
        self.backend = self.engine.backend

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        format: str | None = None,
        precision: str = "auto",
        max_batch: int = 8,
        device: torch.device | str = "cpu",
        fast: bool = True,
        backend: str = "torch",
        calibration: Sequence[str | os.PathLike[str]] | None = None,
    ) -> ServedModel:
        return cls(load_checkpoint(path, format=format), precision, max_batch, device, fast, backend, calibration)

    # ---- facts ----------------------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.model.cfg.num_classes

    @property
    def class_names(self) -> list[str]:
        return [self.loaded.label(i) for i in range(self.num_classes)]

    def card(self) -> dict[str, Any]:
        """The model card: name, classes, resolution, preprocessing, precision."""
        cfg, meta = self.model.cfg, self.loaded.meta
        return {
            "name": cfg.name or f"ViT D={cfg.hidden_size} L={cfg.depth} P={self.model.cfg.stride}",
            "checkpoint": "/".join(Path(os.path.normpath(meta.source)).parts[-2:]),
            "format": meta.format,
            "num_classes": cfg.num_classes,
            "classes": self.class_names,
            "image_size": list(self.preprocess.image_size),
            "patch_size": self.model.cfg.stride,
            "depth": cfg.depth,
            "num_heads": cfg.num_heads,
            "classifier": cfg.classifier,
            "preprocessing": self.preprocess.to_dict(),
            "precision": self.precision,
            "backend": self.backend,
            "device": str(self.device),
        }

    def warm_up(self, max_batch: int) -> None:
        """One forward at batch 1 and at ``max_batch``, so the first requests meet ready kernels
        (:meth:`~vitkit.inference.engine.InferenceEngine.warm_up`)."""
        self.engine.warm_up({1, max_batch})

    # ---- compute --------------------------------------------------------------------------------------

    def to_tensor(self, img: Image.Image) -> torch.Tensor:
        """A decoded image -> the model's input (C, H, W), by the checkpoint's preprocessing."""
        return self.preprocess.to_tensor(img)

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> class probabilities (B, K), float32, through the engine."""
        return self.engine.probabilities(x)

    def attentions(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, int]]:
        """(B, C, H, W) -> (per-layer attention probabilities (B, h, T, T), fp32 logits (B, K), token grid)."""
        out = self.engine.attentions(x)
        assert out.logits is not None
        return list(out.attentions), out.logits.float().cpu(), self.model.grid_of(x)

    def rollout(self, x: torch.Tensor) -> np.ndarray:
        """(B, C, H, W) -> attention rollout maps (B, H, W) in [0, 1], upsampled to the input size."""
        attns, _, grid = self.attentions(x)
        cfg = self.model.cfg
        maps = rollout_maps(attns, grid, cfg.num_prefix_tokens, bool(cfg.class_token))
        return upsample_maps(maps, (x.shape[-2], x.shape[-1])).cpu().numpy()

    def layer_maps(self, attns: list[torch.Tensor], grid: tuple[int, int], layer: int, size: tuple[int, int]) -> Any:
        """One layer's raw attention per head, (B, h, H, W) in [0, 1] (class token, or mean query for GAP)."""
        cfg = self.model.cfg
        maps = attention_maps(attns[layer], grid, cfg.num_prefix_tokens, bool(cfg.class_token))
        return upsample_maps(maps, size).cpu().numpy()

    def run_batch(self, inputs: list[torch.Tensor], want_attention: list[bool]) -> list[Answer]:
        """Answer a batch: probabilities for all, rollout maps for those that asked."""
        x = torch.stack(inputs)  # (B, C, H, W)
        probs = self.probabilities(x)
        maps: dict[int, np.ndarray] = {}
        wanted = [i for i, w in enumerate(want_attention) if w]
        if wanted:
            rolled = self.rollout(x[wanted])
            maps = {i: rolled[j] for j, i in enumerate(wanted)}
        return [Answer(probs[i], maps.get(i)) for i in range(len(inputs))]

    def top_k(self, probs: torch.Tensor, k: int) -> list[dict[str, Any]]:
        """The k most probable classes of one image: label, class index, probability."""
        p, idx = probs.topk(min(k, self.num_classes))
        return [
            {"label": self.loaded.label(int(i)), "index": int(i), "prob": float(v)}
            for v, i in zip(p.tolist(), idx.tolist(), strict=True)
        ]
