"""``vitkit finetune --method linear`` and the first stage of ``lp-ft``: a linear head on frozen features.

The checkpoint's pre-logits features (a pre-logits layer, when it has one, is kept: the head sits on what
the paper's linear probes read) are computed once per weights, data and preprocessing through
:func:`vitkit.train.feature_cache.cached_features` -- ``extract``, the batched forward path of every
evaluation -- plus ``adapt.feature_epochs`` passes through the run's training augmentation; a multinomial
logistic-regression head is fitted on them (:mod:`vitkit.train.probe`) and written into the model. A
``linear`` run folder then holds what a training run holds for every command: ``model/`` (a normal vitkit
checkpoint with the class names), ``config.json``, and ``probe.json`` (the L2 strength, the held-out scores
of the grid, the validation accuracy, the time taken).

Resuming (``vitkit train --resume RUN``) fits again from the run's ``config.json``; the feature chunks an
interrupted run finished come from the cache, and the result is the same.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitkit.configs import TrainConfig
from vitkit.data.image_dataset import ImageDataset
from vitkit.errors import ConfigError
from vitkit.fileio import write_text_atomic
from vitkit.train import build, logs
from vitkit.train import parallel as distr
from vitkit.train.feature_cache import AugmentedPass, Features, backbone_digest, cached_features
from vitkit.train.probe import ProbeFit, fit_probe, write_head
from vitkit.train.run import Run, TrainResult

PROBE_FILE = "probe.json"


def _features(run: Run, dataset: ImageDataset, augment: AugmentedPass | None, desc: str, weights: str) -> Features:
    c = run.cfg
    return cached_features(
        run.net,
        dataset,
        run.preprocess,
        root=c.adapt.feature_cache,
        augment=augment,
        precision=c.adapt.feature_precision,
        batch_size=c.data.eval_batch_size,
        device=run.device,
        workers=run.workers,
        progress=run.progress,
        desc=desc,
        weights=weights,
    )


def training_features(run: Run, weights: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows (P*N, R), labels, each row's example, clean-pass mask) of the training split: the clean pass,
    then ``adapt.feature_epochs`` augmented ones (epochs 1.., the run's training transform and seed)."""
    cfg = run.cfg
    passes = [_features(run, run.train_set, None, "features (train)", weights)]
    if cfg.adapt.feature_epochs:
        transform = build.train_transform(cfg, run.preprocess)
        identity = {"aug": cfg.to_dict()["aug"], "image_size": list(run.preprocess.image_size)}
        for epoch in range(1, cfg.adapt.feature_epochs + 1):
            aug = AugmentedPass(transform, cfg.seed, epoch, identity)
            passes.append(_features(run, run.train_set, aug, f"features (train, augmented pass {epoch})", weights))
    x = np.concatenate([p.features for p in passes])
    y = np.concatenate([p.labels for p in passes])
    n = len(run.train_set)
    examples = np.tile(np.arange(n), len(passes))
    clean = np.arange(len(y)) < n
    return x, y, examples, clean


def fit_linear_head(run: Run) -> ProbeFit:
    """Fit the head on the run's training features and write it into ``run.net`` (the head must already map
    the features to the run's classes: ``build.build_model`` does for linear and lp-ft)."""
    x, y, examples, clean = training_features(run, backbone_digest(run.net))
    a = run.cfg.adapt
    fit = fit_probe(
        x, y, len(run.classes), examples=examples, clean=clean, l2=a.l2, heldout_fraction=a.heldout_fraction,
        seed=run.cfg.seed, progress=run.progress,
    )  # fmt: skip
    for note in fit.notes:
        print(f"note: {note}", file=sys.stderr)
    write_head(run.net, fit)
    return fit


def probe_summary(fit: ProbeFit) -> str:
    if fit.l2_mode == "auto":
        best = next(h for h in fit.heldout if h["l2"] == fit.l2)
        return (
            f"linear head: l2 {fit.l2:g}, chosen on {fit.heldout_count} held-out training examples "
            f"({100 * best['top1']:.2f}% there)"
        )
    return f"linear head: l2 {fit.l2:g} ({fit.l2_mode})"


def write_probe_report(run: Run, fit: ProbeFit, extra: dict[str, Any]) -> None:
    doc = {"method": run.cfg.adapt.method, **fit.to_dict(), **extra}
    write_text_atomic(run.run_dir / PROBE_FILE, json.dumps(doc, indent=2) + "\n")


class LinearRun(Run):
    """``adapt.method = "linear"``: the frozen backbone with a fitted head, saved as the run's ``model/``."""

    def __init__(self, cfg: TrainConfig, run_dir: Any, *, progress: bool = True, claim: bool | str = "exclusive"):
        super().__init__(cfg, run_dir, progress=progress, claim=claim)
        if self.dist.enabled:
            raise ConfigError("adapt.method linear fits its head in one process; run it without torchrun")
        self.net.eval()
        self._sigterm = distr.StopSignal(self.dist)  # from here to close(), SIGTERM raises Terminated

    @torch.no_grad()
    def fit(self) -> TrainResult:
        t0 = time.perf_counter()
        self._clean_after_kill()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        logs.write_config(self.run_dir, self.cfg.to_dict())
        fit = fit_linear_head(self)
        metrics = self.evaluate(self.val_set) if self.val_set is not None else {}
        seconds = time.perf_counter() - t0
        self.save_model("model", val_top1=metrics.get("val_top1"), l2=fit.l2)
        write_probe_report(self, fit, {**metrics, "seconds": seconds})
        return TrainResult(
            self.run_dir,
            0,
            final_top1=metrics.get("val_top1"),
            seconds=time.perf_counter() - t0,
            val_split=self.val_set.split if self.val_set is not None else None,
            final_metrics=metrics,
            notes=[probe_summary(fit)],
            val_precision=self.cfg.adapt.feature_precision if metrics else None,
        )

    def evaluate(self, dataset: ImageDataset) -> dict[str, float]:
        """Top-1 and mean loss of the model on ``dataset``, from its (cached) features through the head."""
        feats = _features(self, dataset, None, f"features ({dataset.split})", backbone_digest(self.net))
        logits = self.net.head(torch.from_numpy(feats.features).to(self.device)).float()  # (N, K), as the model does
        y = torch.from_numpy(feats.labels).to(self.device)
        n = max(len(y), 1)
        return {
            "val_top1": float((logits.argmax(-1) == y).sum()) / n,
            "val_loss": float(F.cross_entropy(logits, y, reduction="sum")) / n,
            "val_count": float(len(y)),
        }
