"""Building a run's model and augmentation from its config: a fresh (seeded) model or a checkpoint with a
new zero head, its evaluation preprocessing, and the training transform."""

from __future__ import annotations

from typing import Any

import torch

from vitkit.checkpoints import load_checkpoint
from vitkit.checkpoints.preprocess import INCEPTION_MEAN, INCEPTION_STD, Preprocess
from vitkit.configs import TrainConfig
from vitkit.data.transforms import RANDAUGMENT_OPS, RandAugment, TrainTransform, triple
from vitkit.errors import ConfigError
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer, ViTConfig


def build_model(cfg: TrainConfig, classes: list[str]) -> tuple[VisionTransformer, Preprocess]:
    """A fresh model (seeded), or a checkpoint with a new zero head at the data's resolution (for the linear
    and lp-ft methods, a head on the checkpoint's own features: its pre-logits layer kept)."""
    d = cfg.data
    m = cfg.model
    gray = bool(d.grayscale)
    if m.init_from:
        loaded = load_checkpoint(m.init_from, image_size=d.image_size, pos_interpolation=m.pos_interpolation)
        net = loaded.model
        if cfg.adapt.method in ("linear", "lp-ft"):  # a head for the frozen features: pre-logits kept
            net.reset_head(len(classes), keep_pre_logits=True)
        elif loaded.meta.class_names != classes:  # new labels: a zero head, no pre-logits (paper)
            net.reset_head(len(classes))
        if m.overrides:  # regularisation changes (dropout, drop_path) on the loaded weights
            net = _with_overrides(net, m.overrides, m.init_from)
        gray = loaded.meta.preprocess.grayscale if d.grayscale is None else d.grayscale
        if net.cfg.in_channels != (1 if gray else 3):
            raise ConfigError(
                f"{m.init_from}: the model takes {net.cfg.in_channels} input channels but data.grayscale is {gray}"
            )
        ref = loaded.meta.preprocess
        mean, std = d.mean or ref.mean, d.std or ref.std
    else:
        torch.manual_seed(cfg.seed)
        overrides = {"num_classes": len(classes), "image_size": d.image_size, "in_channels": 1 if gray else 3}
        overrides.update(m.overrides)
        net = create_model(m.name, **overrides) if m.name else create_model(ViTConfig(), **overrides)
        mean, std = d.mean or INCEPTION_MEAN, d.std or INCEPTION_STD
    net.train()
    pre = Preprocess(
        d.image_size, triple(mean), triple(std), d.eval_resize, d.eval_crop_pct, cfg.aug.interpolation, gray
    )
    return net, pre


def train_transform(cfg: TrainConfig, preprocess: Preprocess) -> TrainTransform:
    """The training augmentation: crop, flip, RandAugment (AugReg level applied), then normalisation."""
    aug = cfg.aug.resolved()
    ra = None
    if aug.randaug_layers > 0:
        ops = tuple(aug.randaug_ops) if aug.randaug_ops else RANDAUGMENT_OPS
        try:
            ra = RandAugment(aug.randaug_layers, aug.randaug_magnitude, ops, aug.randaug_fill)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    p = preprocess
    return TrainTransform(
        p.image_size,
        aug.crop,
        aug.crop_scale,
        aug.crop_ratio,
        aug.pad,
        aug.flip,
        ra,
        p.mean,
        p.std,
        p.grayscale,
        aug.interpolation,
    )


def _with_overrides(net: VisionTransformer, overrides: dict[str, Any], source: str) -> VisionTransformer:
    """The same weights in a model whose config has ``overrides`` (only non-shape fields can change)."""
    try:
        new = VisionTransformer(net.cfg.replace(**overrides))
        new.load_state_dict(net.state_dict(), strict=True)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"{source}: model overrides {sorted(overrides)} cannot apply to a checkpoint ({e})") from None
    return new
