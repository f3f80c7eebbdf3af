"""Exponential moving average (Polyak averaging) of a model's parameters.

After every optimiser step: ``ema = decay * ema + (1 - decay) * param``. With ``warmup`` the decay is
``min(decay, (1 + n) / (10 + n))`` after n updates, so early averages are not dominated by the random
initialisation. The averages live next to the parameters (same device, same sharding under FSDP).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    """Shadow copies of ``model``'s trained parameters, by name (ViT has no persistent buffers to average)."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False) -> None:
        self.decay, self.warmup = decay, warmup
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            n: t.detach().clone() for n, t in model.named_parameters() if t.is_floating_point() and t.requires_grad
        }  # frozen weights (LoRA's base layers) never change: no averages, no copies

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        pairs = [(s, t.detach()) for name, t in model.named_parameters() if (s := self.shadow.get(name)) is not None]
        if all(type(s) is torch.Tensor for s, _ in pairs):  # one kernel for all (a GPU step launches ~50 fewer)
            torch._foreach_lerp_([s for s, _ in pairs], [t for _, t in pairs], 1.0 - d)
        else:  # sharded (FSDP2's DTensors): tensor by tensor
            for s, t in pairs:
                s.lerp_(t, 1.0 - d)  # s + (1 - d) * (t - s) = d * s + (1 - d) * t
        self.updates += 1

    @contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """Temporarily run ``model`` with the averaged weights (e.g. for evaluation or saving)."""
        self._swap(model)
        try:
            yield
        finally:
            self._swap(model)

    @torch.no_grad()
    def _swap(self, model: nn.Module) -> None:
        for name, t in model.named_parameters():
            s = self.shadow.get(name)
            if s is not None:
                tmp = t.detach().clone()
                t.copy_(s)
                s.copy_(tmp)
