"""Optimisers with decoupled weight decay on the right parameters, and learning-rate schedules.

Weight decay applies to weight matrices and kernels only: never to LayerNorm scales/offsets, biases, the
class token or the position embedding (1-D tensors and the named embeddings).

Schedules are pure functions of the step (linear warmup from 0, then cosine or linear decay to
``end_lr``), so resuming needs nothing but the step number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from vitkit.configs import OptimConfig
from vitkit.errors import ConfigError

NO_DECAY_NAMES = ("cls_token", "pos_embed")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether parameter ``name`` gets weight decay: matrices/kernels yes; norms, biases, embeddings no."""
    leaf = name.rsplit(".", 1)[-1]
    return p.ndim >= 2 and leaf not in NO_DECAY_NAMES and not name.endswith(".bias")


def param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two groups, decayed and not; each carries the parameter names (for name-keyed checkpoints)."""
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, p in named:
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append((name, p))
    groups = []
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if members:
            groups.append(
                {"params": [p for _, p in members], "param_names": [n for n, _ in members], "weight_decay": wd}
            )
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW/Adam (decoupled decay) or SGD with momentum, over :func:`param_groups` of ``model``."""
    groups = param_groups(model.named_parameters(), cfg.weight_decay)
    if cfg.name in ("adamw", "adam"):
        # "adam" with weight decay is the paper's Adam + decoupled decay; it is the same update as AdamW.
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **adam_kernel(groups)
        )
    if cfg.name == "sgd":
        if cfg.weight_decay:
            for g in groups:  # decoupled for SGD too: decay after the momentum update, scaled by lr
                g["vitkit_decoupled_wd"] = g["weight_decay"]
                g["weight_decay"] = 0.0
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    raise ConfigError(f"unknown optimiser {cfg.name!r} (adamw, adam, sgd)")


def adam_kernel(groups: list[dict]) -> dict[str, bool]:
    """The fastest Adam implementation PyTorch has for these parameters: ``fused=True`` (one kernel over all
    tensors: 4x fewer memory passes than the per-tensor loop) where every parameter is a plain floating-point
    tensor on a device with fused kernels (CPU, CUDA, ...); else ``foreach=True`` (FSDP2's sharded DTensors
    among others). Both compute the same update as the plain loop, to float rounding (tested)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a private helper: if a later torch moves it, the devices fused Adam has had since 2.4
        supported = {"cpu", "cuda", "mps", "xpu"}
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        DTensor = ()  # type: ignore[assignment,misc]
    params = [p for g in groups for p in g["params"]]
    fusable = all(p.is_floating_point() and p.device.type in supported and not isinstance(p, DTensor) for p in params)
    return {"fused": True} if fusable and params else {"foreach": True}


def apply_decoupled_sgd_decay(opt: torch.optim.Optimizer) -> None:
    """SGD's decoupled weight decay (p -= lr * wd * p), applied right after ``opt.step()``."""
    with torch.no_grad():
        for g in opt.param_groups:
            wd = g.get("vitkit_decoupled_wd", 0.0)
            if wd:
                for p in g["params"]:
                    p.mul_(1.0 - g["lr"] * wd)


def lr_at(
    step: int, *, base_lr: float, total_steps: int, warmup_steps: int, schedule: str, end_lr: float = 0.0
) -> float:
    """Learning rate for optimiser step ``step`` (0-based).

    Warmup: linear from base_lr / warmup to base_lr over ``warmup_steps`` steps (step 0 never has lr 0).
    Then ``cosine``: end + (base - end) * (1 + cos(pi * t)) / 2; ``linear``: base + (end - base) * t;
    ``constant``: base; with t = (step - warmup) / (total - warmup) going from 0 to (almost) 1.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    t = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    t = min(max(t, 0.0), 1.0)
    if schedule == "cosine":
        return end_lr + (base_lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "linear":
        return base_lr + (end_lr - base_lr) * t
    raise ConfigError(f"unknown schedule {schedule!r} (cosine, linear, constant)")


def fitted_warmup(warmup_steps: int, total_steps: int, max_fraction: float | None) -> int:
    """The warm-up a run of ``total_steps`` actually gets: a recipe's (``warmup_steps``, epochs converted with
    this run's epoch length) when it is at most ``max_fraction`` of the run, else that fraction of the run
    (rounded, at least 1 step): a recipe sized for ImageNet (10k steps of batch 1024) run on 32 images for 60
    steps warms up for 12, so its learning rate reaches its value and then decays as the recipe intends.
    ``max_fraction`` None: ``warmup_steps`` as given."""
    if max_fraction is None or warmup_steps <= max_fraction * total_steps:
        return warmup_steps
    return max(1, round(max_fraction * total_steps))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
