"""The training loop: pre-training from scratch and fine-tuning, resumable bit-for-bit, 1 to N processes.

``train(cfg, run_dir)`` writes a run folder::

    run_dir/
      config.json        the resolved TrainConfig
      model/             final weights (the EMA weights when EMA is on) in vitkit format, with the
                         evaluation preprocessing and class names: ``vitkit predict -c run_dir`` works
      best/              the weights with the best validation top-1 so far (when there is validation)
      checkpoints/       resumable state, the newest ``keep_last`` (training state, see state.py)
      metrics.csv        per epoch: train loss, validation loss and top-1, lr, throughput, skipped steps
      steps.csv          every ``log_every_steps`` steps: loss, lr, throughput
      curves.png         loss and accuracy curves
      tb/                TensorBoard events (when tensorboard is installed)

Determinism: every random draw is a pure function of the seed and the position -- the epoch order of
(seed, epoch), each sample's augmentation of (seed, epoch, index), Mixup/CutMix and dropout/stochastic
depth of (seed, step, rank) -- so resuming needs no RNG state: weights, optimiser moments, EMA, the step
and two running sums are enough, and a resumed run equals an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitkit.configs import TrainConfig
from vitkit.data.loader import Batch, TrainLoader
from vitkit.data.mix import Mixer, soft_cross_entropy
from vitkit.data.resident import resident_loader
from vitkit.errors import ConfigError, VitkitError
from vitkit.hardware import CpuShare
from vitkit.models.kernel_paths import set_fused_attention, set_training_kernels
from vitkit.train import build, kernels, logs
from vitkit.train import parallel as distr
from vitkit.train import state as train_state
from vitkit.train.ema import EMA
from vitkit.train.heap import heap_kept
from vitkit.train.optim import apply_decoupled_sgd_decay, build_optimizer, fitted_warmup, lr_at, set_lr
from vitkit.train.run import TrainResult, check_run_dir, check_run_links, step_seed, train_precision
from vitkit.train.state import resume_config
from vitkit.train.training_path import TrainingPath, choose_training_path, explicit_attention
from vitkit.train.validation import ValidatedRun


class NonFiniteLossError(VitkitError):
    """The loss or the gradient norm became NaN/inf (and skipping was not requested)."""


class Trainer(ValidatedRun):
    """Owns the model, optimiser, data and state of one run; ``fit()`` runs it to the end."""

    def __init__(
        self, cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, claim: bool | str = "exclusive"
    ) -> None:
        super().__init__(cfg, run_dir, progress=progress, claim=claim)
        self.cpu_share: CpuShare | None = None  # while fit runs: threads follow the free cores
        self.skipped = 0
        self.best_top1: float | None = None
        self.epoch_loss = [0.0, 0]  # running sum and count of the current epoch's step losses
        self.history: list[dict[str, float]] = []
        self.epoch_rows: list[dict[str, Any]] = []
        self.explicit_attention = explicit_attention(cfg.attention, self.device, self.net.cfg, self._micro_batch())
        self.training_path: TrainingPath | None = None
        set_fused_attention(self.net, not self.explicit_attention)
        self.model = distr.wrap(
            self.net, cfg.distributed, self.dist, grad_checkpointing=cfg.grad_checkpointing, precision=self.precision
        )
        self.forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(self.model) if cfg.compile else self.model
        self.opt = build_optimizer(self.net, cfg.optim)
        self.ema = EMA(self.net, cfg.ema_decay, cfg.ema_warmup) if cfg.ema_decay else None
        transform = build.train_transform(cfg, self.preprocess)
        order: dict[str, Any] = dict(
            global_batch=cfg.data.batch_size, seed=cfg.seed, accum_steps=cfg.accum_steps, rank=self.dist.rank,
            world=self.dist.world,
        )  # fmt: skip
        # a small greyscale array set (the default digits job) is held and augmented on the device, the same
        # batches bit for bit (data/resident.py); anything else goes through the host loader
        self.loader: TrainLoader = resident_loader(
            self.train_set, transform, device=self.device, **order
        ) or TrainLoader(
            self.train_set, transform, workers=self.workers, pin_memory=self.device.type == "cuda", **order
        )
        if self.device.type == "cpu" and not cfg.compile:  # inductor fuses on its own
            # the C kernels (bf16 tensors only), or PyTorch's ops where a race on one block says they are faster
            # (after the data's checks: a refused batch size costs no race); the wrapped model shares these modules
            self.training_path = self._training_path()
            self.explicit_attention = self.training_path.explicit
            set_training_kernels(self.net, self.training_path.kernels)
            set_fused_attention(self.net, not self.explicit_attention)
            if self.training_path.changed and self.dist.is_main:
                print(f"note: {self.training_path.describe()}", file=sys.stderr)
        aug = cfg.aug.resolved()
        self.mixer = Mixer(
            len(self.classes), aug.mixup, aug.cutmix, aug.mix_prob, aug.mix_switch_prob, aug.label_smoothing
        )
        spe = self.loader.steps_per_epoch
        self.total_steps = cfg.steps if cfg.steps is not None else max(1, round((cfg.epochs or 0) * spe))
        given = cfg.optim.warmup_steps + round(cfg.optim.warmup_epochs * spe)
        self.warmup_steps = fitted_warmup(given, self.total_steps, cfg.optim.warmup_max_fraction)
        if self.warmup_steps != given and self.dist.is_main:
            share = cfg.optim.warmup_max_fraction
            print(
                f"note: the recipe's warm-up ({given} steps, sized for its own data set) is longer than {share:.0%} "
                f"of this run ({self.total_steps} steps of batch {cfg.data.batch_size}); warming up for "
                f"{self.warmup_steps} steps instead (--set optim.warmup_max_fraction=null keeps it as given)",
                file=sys.stderr,
            )
        elif self.warmup_steps >= self.total_steps > 1 and cfg.optim.schedule != "constant" and self.dist.is_main:
            print(
                f"note: the warm-up ({self.warmup_steps} steps) fills the whole run ({self.total_steps} steps), so "
                "the learning rate never decays; shorten it with --set optim.warmup_steps=N (and "
                "optim.warmup_epochs=0)",
                file=sys.stderr,
            )
        # adapt.select: the weights kept are the best on select_set, evaluated every select_every steps
        self.select_every = cfg.adapt.eval_every_steps or max(1, math.ceil(self.total_steps / 20))
        self.best_step: int | None = None
        self._best_loss = math.inf
        self._best_state: dict[str, torch.Tensor] | None = None
        self._sigterm = distr.StopSignal(self.dist)  # from here to close(), SIGTERM raises Terminated

    def _micro_batch(self) -> int:
        return math.ceil(self.cfg.data.batch_size / (self.dist.world * self.cfg.accum_steps))

    def _training_path(self) -> TrainingPath:
        """The CPU step's kernels: the built-in rule, or raced (``vitkit.train.training_path``) with
        ``attention="measure"``."""
        if self.cfg.attention != "measure":  # the built-in rule (or the kernel set by hand): reproducible
            return TrainingPath(self.explicit_attention, kernels.load(), self.cfg.attention, {}, "as set")
        return choose_training_path(self.net, self._micro_batch(), self.precision, self.explicit_attention)

    # ---- one optimiser step -------------------------------------------------------------------------

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient all-reduce on accumulation micro-batches except the last."""
        if isinstance(self.model, nn.parallel.DistributedDataParallel) and not last:
            return self.model.no_sync()
        set_sync = getattr(self.net, "set_requires_gradient_sync", None)  # FSDP2
        if set_sync is not None:
            set_sync(last)
        return contextlib.nullcontext()

    def train_step(self, micro: list[Batch]) -> dict[str, float]:
        """Forward/backward over the micro-batches, clip, step; returns the step's mean loss and lr."""
        cfg = self.cfg
        lr = lr_at(
            self.step,
            base_lr=cfg.optim.lr,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            schedule=cfg.optim.schedule,
            end_lr=cfg.optim.end_lr,
        )
        set_lr(self.opt, lr)
        torch.manual_seed(step_seed(cfg.seed, self.step, self.dist.rank))
        mix_rng = np.random.default_rng([cfg.seed, self.step, self.dist.rank, 0x313])
        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for m, batch in enumerate(micro):
            x = batch.images.to(self.device, non_blocking=True)
            y = batch.labels.to(self.device, non_blocking=True)
            x, target = self.mixer(x, y, mix_rng)
            with self._sync_context(m == len(micro) - 1), self._autocast():
                loss = soft_cross_entropy(self.forward(x), target, cfg.loss)
                (loss / len(micro)).backward()
            loss_sum += loss.detach()
        params = [p for p in self.net.parameters() if p.grad is not None]
        max_norm = cfg.optim.clip_norm if cfg.optim.clip_norm else float("inf")
        gnorm = distr.full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))
        stats = torch.stack([loss_sum / len(micro), (~torch.isfinite(gnorm.detach())).float()]).to(self.device)
        stats = distr.all_reduce_sum(stats, self.dist)
        loss_mean = float(stats[0]) / self.dist.world
        if float(stats[1]) > 0 or not math.isfinite(loss_mean):
            if not cfg.skip_nonfinite:
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at step {self.step} (loss {loss_mean}); lower the learning "
                    "rate, or pass --skip-nonfinite to skip such steps"
                )
            self.opt.zero_grad(set_to_none=True)
            self.skipped += 1
        else:
            self.opt.step()
            apply_decoupled_sgd_decay(self.opt)
            if self.ema is not None:
                self.ema.update(self.net)
            self.epoch_loss[0] += loss_mean
            self.epoch_loss[1] += 1
        self.step += 1
        return {"step": float(self.step), "loss": loss_mean, "lr": lr, "grad_norm": float(gnorm)}

    # ---- saving ---------------------------------------------------------------------------------------

    def save_state(self) -> None:
        """Write the resumable state (every process takes part; process 0 writes)."""
        counters = {
            "epoch_loss": self.epoch_loss,
            "skipped_steps": self.skipped,
            "best_top1": self.best_top1,
            "best_step": self.best_step,
            "best_loss": self._best_loss if self.best_step is not None else None,
        }
        train_state.save_training(
            self.run_dir / "checkpoints", self.step, self._trained(), self._full_model_state(),
            self._best_state or {}, counters, self.classes, self.cfg.to_dict(), self.cfg.keep_last,
        )  # fmt: skip

    def load_state(self, path: str | Path) -> None:
        """Restore everything from a checkpoint written by :meth:`save_state`."""
        meta, best = train_state.load_training(path, self._trained(), self.classes)
        self.step, self.skipped = int(meta["step"]), int(meta["skipped_steps"])
        self.best_top1, self.best_step = meta.get("best_top1"), meta.get("best_step")
        if self.best_step is not None:  # the weights selected so far (adapt.select)
            self._best_loss, self._best_state = float(meta["best_loss"]), best
        self.epoch_loss = [float(meta["epoch_loss"][0]), int(meta["epoch_loss"][1])]

    def _trained(self) -> train_state.Trained:
        return self.net, self.opt, self.ema, self.dist

    # ---- the loop ---------------------------------------------------------------------------------------

    def fit(
        self, resume: str | Path | None = None, *, on_step: Callable[[Trainer, dict[str, float]], None] | None = None
    ) -> TrainResult:
        """Train to ``total_steps``; ``on_step(trainer, record)`` is called after every step (tests, hooks)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        notes = self._start(resume)
        last_eval: dict[str, float] = {}
        started = time.perf_counter()
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (self.progress and self.dist.is_main),
            desc=self.cfg.name,
        )
        self.cpu_share = CpuShare(say=lambda line: tqdm.write(line, file=sys.stderr) if self.dist.is_main else None)
        try:
            with heap_kept(), bar:  # freed activations stay in the heap for the next step (heap.py)
                while self.step < self.total_steps:
                    images = self._run_epoch(bar, on_step)
                    last_eval, started = self._end_epoch(images, started)
            return self._finish(notes, last_eval, t0)
        finally:
            self.cpu_share.close()

    def _start(self, resume: str | Path | None) -> list[str]:
        """Clean what a killed run left, restore the state to resume from, start the logs (config.json first: a
        stage-1 crash leaves a resumable run), and LP-FT's first stage; returns the notes for the result."""
        self._clean_after_kill()
        notes: list[str] = []
        if resume is not None:
            self.load_state(train_state.resolve_resume(resume))
        if self.dist.is_main:
            self.epoch_rows, self._tb = logs.start(self.run_dir, self.cfg.to_dict(), self.step, resume is not None)
        if resume is None and self.cfg.adapt.method == "lp-ft":
            notes.append(self._linear_probe_head())
        if self.select_set is not None and self.step == 0:
            self._select()  # step 0 is a candidate: for lp-ft, the linear head it starts from
        return notes

    def _run_epoch(self, bar: Any, on_step: Callable[[Trainer, dict[str, float]], None] | None) -> int:
        """The steps of the current epoch, from where it stands to its end or the last step (selection, step
        logs and mid-epoch states on their schedules); returns the images trained on."""
        cfg, spe = self.cfg, self.loader.steps_per_epoch
        images, t_last = 0, time.perf_counter()
        for micro in self.loader.epoch(self.step // spe, self.step % spe):
            rec = self.train_step(micro)
            if self.cpu_share is not None:
                self.cpu_share.tick()  # threads follow the cores other programs leave (hardware.CpuShare)
            self.history.append(rec)
            if self.select_set is not None and (self.step % self.select_every == 0 or self.step == self.total_steps):
                self._select()
            now = time.perf_counter()
            ips, t_last = cfg.data.batch_size / max(now - t_last, 1e-9), now
            images += cfg.data.batch_size
            bar.update(1)
            if self.step % cfg.log_every_steps == 0 or self.step == self.total_steps:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", img_s=f"{ips:.0f}")
                if self.dist.is_main:
                    logs.log_step(self.run_dir, self._tb, rec, ips)
            every = cfg.checkpoint_every_steps
            if every and self.step % every == 0 and self.step % spe and self.step < self.total_steps:
                self.save_state()  # mid-epoch; epoch ends are checkpointed by _end_epoch, after the metrics
            if on_step is not None:
                on_step(self, rec)
            if self.step >= self.total_steps:
                break
        return images

    def _end_epoch(self, images: int, started: float) -> tuple[dict[str, float], float]:
        """The end of an epoch (or of training): validation when due, the epoch's metrics row, the best weights so
        far, the training state. Returns the validation metrics and the time the next epoch's clock starts."""
        spe = self.loader.steps_per_epoch
        ep = (self.step - 1) // spe
        due = self.step >= self.total_steps or (ep + 1) % self.cfg.eval_every_epochs == 0
        last_eval = self.evaluate() if due and self.select_set is None else {}  # selecting: after the loop
        seconds = time.perf_counter() - started
        row = {
            "epoch": ep + 1 if self.step % spe == 0 else round(self.step / spe, 3),
            "step": self.step,
            "train_loss": self.epoch_loss[0] / max(self.epoch_loss[1], 1),
            "val_loss": last_eval.get("val_loss", float("nan")),
            "val_top1": last_eval.get("val_top1", float("nan")),
            "lr": self.opt.param_groups[0]["lr"],
            "images_per_s": round(images / max(seconds, 1e-9), 1),
            "skipped_steps": self.skipped,
        }
        self.epoch_loss = [0.0, 0]
        started = time.perf_counter()
        self.epoch_rows.append(row)
        if self.dist.is_main:
            logs.log_epoch(self.run_dir, self._tb, row)
        top1 = last_eval.get("val_top1")
        if top1 is not None and (self.best_top1 is None or top1 > self.best_top1):
            self.best_top1 = top1
            self.save_model("best", val_top1=top1)
        self.save_state()
        return last_eval, started

    def _finish(self, notes: list[str], last_eval: dict[str, float], t0: float) -> TrainResult:
        """The selected weights kept (adapt.select), the final model saved, the curves drawn; the result."""
        kept: dict[str, Any] = {}
        if self.select_set is not None:
            notes.append(self._keep_selected())
            last_eval = self.evaluate()
            kept = {"selected_step": self.best_step, "selected_top1": self.best_top1}
            kept["selected_on"] = self._select_name()
        if self.cpu_share is not None and self.cpu_share.fewest < self.cpu_share.threads:
            notes.append(
                f"the machine was busy: part of this run used {self.cpu_share.fewest} of its "
                f"{self.cpu_share.threads} threads, and sums split by the thread count round differently, so a "
                "rerun or resume equals it to float rounding, not bit for bit (OMP_NUM_THREADS fixes the count)"
            )
        self.save_model("model", val_top1=last_eval.get("val_top1"), **kept)
        if self.dist.is_main:
            logs.plot_curves(self.run_dir / "metrics.csv", self.run_dir / "curves.png")
            if self._tb is not None:
                self._tb.close()
                self._tb = None
        return TrainResult(
            self.run_dir,
            self.step,
            self.history,
            self.epoch_rows,
            last_eval.get("val_top1"),
            self.best_top1,
            self.skipped,
            time.perf_counter() - t0,
            self.val_set.split if self.val_set is not None else None,
            last_eval,
            self.dist.rank,
            notes,
            self._val_used if last_eval else None,
            selected_step=self.best_step if self.select_set is not None else None,
        )

    # ---- model selection (adapt.select) -------------------------------------------------------------------

    def _select_name(self) -> str:
        assert self.select_set is not None
        return f"{self.select_set.split} ({len(self.select_set)} images)"

    def _select(self) -> None:
        """Evaluate the current weights on the selection split; keep a copy when they are the best so far
        (higher top-1, then lower loss; a later step wins a tie)."""
        m = self.evaluate(self.select_set)
        top1, loss = m["val_top1"], m["val_loss"]
        if self.dist.is_main:
            logs.append_csv(self.run_dir / "selection.csv", {"step": self.step, "val_top1": top1, "val_loss": loss})
        if self.best_step is None or self.best_top1 is None or (top1, -loss) >= (self.best_top1, -self._best_loss):
            self.best_step, self.best_top1, self._best_loss = self.step, top1, loss
            # the frozen weights never change: only what trains is kept (LoRA: MBs, not the model)
            with self.ema_weights():
                self._best_state = self._full_model_state(trained_only=True)

    def _keep_selected(self) -> str:
        """Put the selected weights back into the model (they are the EMA weights when EMA is on, so EMA is
        done with); returns the line that says which step was kept."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        assert self._best_state is not None and self.best_top1 is not None
        if self.best_step != self.step:
            kept = {**self._full_model_state(), **self._best_state}  # the frozen weights are today's
            state: dict[str, Any] = {k: v.to(self.device) for k, v in kept.items()}
            # several processes: _full_model_state gave the full copy to process 0 only (cpu_offload), which sends it
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.dist.world > 1)
            set_model_state_dict(self.net, state, options=opts)
        self.ema = None
        return (
            f"kept the weights of step {self.best_step} of {self.step}: {100 * self.best_top1:.2f}% top-1 on "
            f"{self._select_name()}, evaluated every {self.select_every} steps"
        )

    def _linear_probe_head(self) -> str:
        """LP-FT's first stage (Kumar et al., ICLR 2022): the head fitted on the frozen features
        (``vitkit.train.linear``) on process 0 and shared; every weight is then trained from it. Returns the
        line that says how its L2 strength was chosen."""
        from vitkit.train.linear import fit_linear_head, probe_summary, write_probe_report

        line = ""
        if self.dist.is_main:
            set_fused_attention(self.net, True)  # features as every evaluation computes them (and caches them)
            fit = fit_linear_head(self)
            set_fused_attention(self.net, not self.explicit_attention)
            write_probe_report(self, fit, {})
            line = probe_summary(fit)
        with torch.no_grad():
            for p in self.net.head.parameters():
                if not self.dist.is_main:
                    p.zero_()
                distr.all_reduce_sum(p.data, self.dist)  # process 0's head, on every process
        if self.ema is not None:  # the averages start from the fitted head too
            self.ema = EMA(self.net, self.cfg.ema_decay or 0.0, self.cfg.ema_warmup)
        self.net.train()
        return line


def train(
    cfg: TrainConfig | None = None,
    run_dir: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (default ``runs/<name>``, numbered when taken; a given folder must not
    hold a run yet), or continue the run at ``resume`` exactly (its saved config; 1..N processes alike)."""
    state: Path | None = None
    claim: bool | str
    if resume is not None:
        if cfg is not None or run_dir is not None:
            raise ConfigError("resume continues a run with its saved config and folder; give only resume=")
        cfg, folder, state = resume_config(resume)
        check_run_links(folder)  # a planted curves.png or config.json link: refused, never written through
        claim = False
    elif cfg is None:
        raise ConfigError("nothing to run: give a config or a run to resume")
    else:
        folder = Path(run_dir) if run_dir is not None else Path("runs") / cfg.name
        claim = "numbered" if run_dir is None else "exclusive"
    again = resume is not None and state is None  # stopped before its first training state: from step 0
    if cfg.adapt.method == "linear":  # no gradient steps: a head fitted on frozen features
        from vitkit.train.linear import LinearRun

        with LinearRun(cfg, folder, progress=progress, claim=claim) as run:
            _note_again(run, again)
            return run.fit()
    with Trainer(cfg, folder, progress=progress, claim=claim) as trainer:
        _note_again(trainer, again)
        return trainer.fit(state)


def _note_again(run: Any, again: bool) -> None:
    if again and run.dist.is_main:
        print(
            f"note: {run.run_dir}: stopped before its first checkpoint; starting it again from step 0 with its "
            "config.json",
            file=sys.stderr,
        )


__all__ = [
    "NonFiniteLossError",
    "TrainResult",
    "Trainer",
    "check_run_dir",
    "resume_config",
    "soft_cross_entropy",
    "step_seed",
    "train",
    "train_precision",
]
