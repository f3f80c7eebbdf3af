"""The validation pass of a :class:`~vitkit.train.trainer.Trainer`: top-1 and mean loss of the current (EMA,
when on) weights over a split, on the training model or, for a large pass on one CPU process, on the inference
engine's fast path packed from those weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.configs import TrainConfig
from vitkit.data.image_dataset import ImageDataset
from vitkit.data.loader import Batch, eval_batches
from vitkit.data.resident import resident_eval_batches
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.policy import EnginePlan, validation_plan
from vitkit.models.kernel_paths import set_fused_attention
from vitkit.train import parallel as distr
from vitkit.train.run import Run


class ValidatedRun(Run):
    """A run that trains a model (set by :class:`~vitkit.train.trainer.Trainer`: ``model``, the wrapped one;
    ``forward``, compiled or not; ``explicit_attention``, the training steps' choice), and validates it."""

    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    explicit_attention: bool

    def __init__(
        self, cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, claim: bool | str = "exclusive"
    ) -> None:
        super().__init__(cfg, run_dir, progress=progress, claim=claim)
        self._resident_eval: dict[int, list[Batch]] = {}  # id(dataset) -> its evaluation batches on the device
        self._val_plans: dict[int, EnginePlan | None] = {}  # tokens of a pass -> its engine's plan (None: the model)
        self._val_used = self.precision  # what the last validation pass computed in

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, dataset: ImageDataset | None = None) -> dict[str, float]:
        """Top-1 and mean loss of the current (EMA, when on) weights over the validation set."""
        ds = dataset or self.val_set
        if ds is None:
            return {}
        self.model.eval()
        set_fused_attention(self.net, True)  # no backward: the fused kernel, which never holds (B, h, T, T)
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # correct, loss sum, count
        with self.ema_weights():
            forward, autocast = self._validation_forward(ds)
            for b in self._eval_batches(ds):
                x, y = b.images.to(self.device, non_blocking=True), b.labels.to(self.device, non_blocking=True)
                with autocast:
                    logits = forward(x).float()
                if b.valid is not None:  # padding that keeps every process's forward passes in step
                    keep = b.valid.to(self.device)
                    logits, y = logits[keep], y[keep]
                totals[0] += (logits.argmax(-1) == y).sum()
                totals[1] += F.cross_entropy(logits, y, reduction="sum")
                totals[2] += y.numel()
            reshard = getattr(self.net, "reshard", None)  # FSDP2 keeps the root unsharded after a forward
            if reshard is not None:
                reshard()
        self.model.train()
        set_fused_attention(self.net, not self.explicit_attention)
        totals = distr.all_reduce_sum(totals, self.dist)
        n = max(float(totals[2]), 1.0)
        return {"val_top1": float(totals[0]) / n, "val_loss": float(totals[1]) / n, "val_count": float(totals[2])}

    def _eval_batches(self, ds: ImageDataset) -> Iterable[Batch]:
        """The evaluation batches of ``ds``: for a small in-memory set (``resident_eval_batches``), prepared on
        the device at the first pass and kept (the transform is deterministic: the same tensors every pass)."""
        kept = self._resident_eval.get(id(ds))
        if kept is None:
            kept = resident_eval_batches(
                ds, self.preprocess.to_tensor, self.cfg.data.eval_batch_size,
                rank=self.dist.rank, world=self.dist.world, device=self.device,
            )  # fmt: skip
            if kept is not None:
                self._resident_eval[id(ds)] = kept
        if kept is not None:
            return kept
        return eval_batches(
            ds, self.preprocess.to_tensor, self.cfg.data.eval_batch_size,
            rank=self.dist.rank, world=self.dist.world, workers=self.workers, pin_memory=self.device.type == "cuda",
        )  # fmt: skip

    def _validation_forward(self, dataset: ImageDataset) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
        """(forward, autocast context) of a validation pass over ``dataset``: the inference engine's fast path,
        built now from the current (EMA, when on) weights, where the policy plans one
        (:func:`vitkit.inference.policy.validation_plan`: one process on the CPU and a large enough pass; planned
        once per pass size), else the training model under the run's autocast."""
        tokens = len(dataset) * self.net.cfg.num_tokens()
        if tokens not in self._val_plans:
            self._val_plans[tokens] = validation_plan(
                self.precision, self.device, tokens, processes=self.dist.world, compile=self.cfg.compile,
                batch_size=self.cfg.data.eval_batch_size,
            )  # fmt: skip
        plan = self._val_plans[tokens]
        if plan is None:
            self._val_used = self.precision
            return self.forward, self._autocast()
        self._val_used = plan.precision
        engine = InferenceEngine(self.net, self.preprocess, plan=plan, batch_size=self.cfg.data.eval_batch_size)
        return engine.logits, contextlib.nullcontext()
