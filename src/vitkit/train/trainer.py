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
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitkit.configs import TrainConfig
from vitkit.data.base import ImageDataset
from vitkit.data.loader import Batch, TrainLoader, eval_batches
from vitkit.data.mix import Mixer, soft_cross_entropy
from vitkit.data.resident import resident_eval_batches, resident_loader
from vitkit.errors import CheckpointError, ConfigError, VitkitError
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.policy import resolve_precision
from vitkit.models.vit import ViTConfig
from vitkit.train import build, kernels, logs
from vitkit.train import distributed as distr
from vitkit.train import state as train_state
from vitkit.train.ema import EMA
from vitkit.train.heap import heap_kept
from vitkit.train.optim import apply_decoupled_sgd_decay, build_optimizer, fitted_warmup, lr_at, set_lr
from vitkit.train.run import Run, TrainResult, check_run_dir, step_seed, train_precision
from vitkit.train.state import resume_config
from vitkit.train.tune import TrainingPath, choose_training_path

EXPLICIT_ATTENTION_BYTES = 1 << 30  # attention "auto" on CPU: most probabilities the explicit kernel may keep
# a validation pass of at least this many tokens (images x tokens per image) runs on the inference fast path,
# packed from the current weights; smaller ones on the model itself (see Trainer._validation_forward)
VALIDATION_FAST_TOKENS = 20_000


class NonFiniteLossError(VitkitError):
    """The loss or the gradient norm became NaN/inf (and skipping was not requested)."""


def explicit_attention(choice: str, device: torch.device, model: ViTConfig, micro_batch: int) -> bool:
    """Whether training steps run the explicit softmax attention (else the fused SDPA kernel; evaluation always
    runs the fused one). ``choice`` "auto": the explicit softmax on CPU, whose backward is faster than PyTorch's
    fused CPU kernel at every ViT length measured (17-577 tokens, BENCHMARKS.md), as long as the probabilities it
    keeps for the backward pass stay under EXPLICIT_ATTENTION_BYTES; the fused (flash) kernel on GPU and for long
    sequences."""
    if choice not in ("auto", "measure"):  # "measure": the rule is the race's built-in candidate (vitkit.train.tune)
        return choice == "explicit"
    if device.type != "cpu":
        return False
    kept = micro_batch * model.num_heads * model.num_tokens() ** 2 * 4 * model.depth  # fp32 probabilities, all layers
    return kept <= EXPLICIT_ATTENTION_BYTES


class Trainer(Run):
    """Owns the model, optimiser, data and state of one run; ``fit()`` runs it to the end."""

    def __init__(
        self, cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, claim: bool | str = "exclusive"
    ) -> None:
        super().__init__(cfg, run_dir, progress=progress, claim=claim)
        self.skipped = 0
        self.best_top1: float | None = None
        self.epoch_loss = [0.0, 0]  # running sum and count of the current epoch's step losses
        self.history: list[dict[str, float]] = []
        self.epoch_rows: list[dict[str, Any]] = []
        self.explicit_attention = self._explicit_attention()
        self.training_path: TrainingPath | None = None
        self.net.set_fused_attention(not self.explicit_attention)
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
            self.net.set_training_kernels(self.training_path.kernels)
            self.net.set_fused_attention(not self.explicit_attention)
            if self.training_path.changed and self.dist.is_main:
                print(f"note: {self.training_path.describe()}", file=sys.stderr)
        self._resident_eval: dict[int, list[Batch]] = {}  # id(dataset) -> its evaluation batches on the device
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
        self._val_precision: str | None = None  # the validation pass's (see _validation_forward)
        self._val_used = self.precision  # what the last validation pass computed in
        self._sigterm = distr.StopSignal(self.dist)  # from here to close(), SIGTERM raises Terminated

    def _micro_batch(self) -> int:
        return math.ceil(self.cfg.data.batch_size / (self.dist.world * self.cfg.accum_steps))

    def _explicit_attention(self) -> bool:
        return explicit_attention(self.cfg.attention, self.device, self.net.cfg, self._micro_batch())

    def _training_path(self) -> TrainingPath:
        """The CPU step's kernels: the built-in rule, or raced (``vitkit.train.tune``) with ``attention="measure"``."""
        if self.cfg.attention != "measure":  # the built-in rule (or the kernel set by hand): reproducible
            return TrainingPath(self.explicit_attention, kernels.load(), self.cfg.attention, {}, "as set")
        return choose_training_path(self.net, self._micro_batch(), self.precision, self.explicit_attention)

    # ---- one optimiser step -------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
        gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        gnorm = distr.full_tensor(gnorm)
        stats = torch.stack([loss_sum / len(micro), (~torch.isfinite(gnorm.detach())).float()]).to(self.device)
        stats = distr.all_reduce_sum(stats, self.dist)
        loss_mean = float(stats[0]) / self.dist.world
        bad = float(stats[1]) > 0 or not math.isfinite(loss_mean)
        if bad:
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

    # ---- evaluation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, dataset: ImageDataset | None = None) -> dict[str, float]:
        """Top-1 and mean loss of the current (EMA, when on) weights over the validation set."""
        ds = dataset or self.val_set
        if ds is None:
            return {}
        ctx = self.ema.swapped_in(self.net) if self.ema is not None else contextlib.nullcontext()
        self.model.eval()
        self.net.set_fused_attention(True)  # no backward: the fused kernel, which never holds (B, h, T, T)
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # correct, loss sum, count
        with ctx:
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
        self.net.set_fused_attention(not self.explicit_attention)
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
            ds,
            self.preprocess.to_tensor,
            self.cfg.data.eval_batch_size,
            rank=self.dist.rank,
            world=self.dist.world,
            workers=self.workers,
            pin_memory=self.device.type == "cuda",
        )

    def _validation_forward(self, dataset: ImageDataset) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
        """(forward, autocast context) of a validation pass over ``dataset``. One process on the CPU, and a pass
        of at least ``VALIDATION_FAST_TOKENS`` tokens (images x tokens per image): the inference engine's fast
        path, built now from the current (EMA, when on) weights, in fp32 for an fp32 run (the model's function up
        to fp32 rounding), for a bf16 run in bf16 where that is native and faster than fp32 (else fp32).
        Otherwise (smaller passes, GPUs, several processes, torch.compile): the training model under the run's
        autocast. Packing the weights costs about what the fast path saves on ~12,000 tokens (B/16 and S/16 at
        224 px, 64 images: 0.98-0.99x the model's own pass; the default digits job's 5,700: 1.51x; BENCHMARKS.md,
        benchmarks/validation_pass.py), so smaller passes keep the model."""
        small = len(dataset) * self.net.cfg.num_tokens() < VALIDATION_FAST_TOKENS
        if small or self.dist.world > 1 or self.device.type != "cpu" or self.cfg.compile:
            self._val_used = self.precision
            return self.forward, self._autocast()
        if self._val_precision is None:
            self._val_precision = "fp32" if self.precision == "fp32" else resolve_precision("auto", self.device)
        self._val_used = self._val_precision
        engine = InferenceEngine(
            self.net, self.preprocess, precision=self._val_precision, device=self.device,
            batch_size=self.cfg.data.eval_batch_size, fp32_reference=False,
        )  # fmt: skip
        return engine.logits, contextlib.nullcontext()

    # ---- saving ---------------------------------------------------------------------------------------

    def save_state(self) -> None:
        """Write the resumable state (every process takes part; process 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = self._full_model_state()
        osd = get_optimizer_state_dict(self.net, self.opt, options=opts)
        ema = {k: distr.full_tensor(v).cpu() for k, v in self.ema.shadow.items()} if self.ema else {}
        if self.dist.is_main:
            opt_tensors, opt_doc = train_state.flatten_optimizer(osd)
            tensors = {f"model/{k}": v for k, v in model_sd.items()}
            tensors.update(opt_tensors)
            tensors.update({f"ema/{k}": v for k, v in ema.items()})
            tensors.update({f"best/{k}": v for k, v in (self._best_state or {}).items()})
            meta = {
                "epoch_loss": self.epoch_loss,
                "skipped_steps": self.skipped,
                "best_top1": self.best_top1,
                "best_step": self.best_step,
                "best_loss": self._best_loss if self.best_step is not None else None,
                "ema_updates": self.ema.updates if self.ema else 0,
                "optimizer": opt_doc,
                "class_names": self.classes,
                "world_size": self.dist.world,
                "config": self.cfg.to_dict(),
            }
            train_state.write_state(self.run_dir / "checkpoints", self.step, tensors, meta, self.cfg.keep_last)
        distr.barrier(self.dist)

    def load_state(self, path: str | Path) -> None:
        """Restore everything from a checkpoint written by :meth:`save_state`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        tensors, meta = train_state.read_state(path)
        if meta.get("class_names") != self.classes:
            raise CheckpointError(f"{path}: the checkpoint's classes differ from the dataset's")
        opts = StateDictOptions(full_state_dict=True)
        model_sd: dict[str, Any] = {
            k[len("model/") :]: v.to(self.device) for k, v in tensors.items() if k.startswith("model/")
        }
        try:
            set_model_state_dict(self.net, model_sd, options=opts)
            osd = train_state.unflatten_optimizer(tensors, meta["optimizer"])
            set_optimizer_state_dict(self.net, self.opt, osd, options=opts)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: does not match this model/optimiser ({e})") from None
        if self.ema is not None:
            for name, shadow in self.ema.shadow.items():
                if f"ema/{name}" not in tensors:
                    raise CheckpointError(f"{path}: no EMA weights for {name}")
                distr.load_full_into(shadow, tensors[f"ema/{name}"])
            self.ema.updates = int(meta["ema_updates"])
        self.step = int(meta["step"])
        self.skipped = int(meta["skipped_steps"])
        self.best_top1 = meta.get("best_top1")
        self.best_step = meta.get("best_step")
        if self.best_step is not None:  # the weights selected so far (adapt.select)
            self._best_loss = float(meta["best_loss"])
            self._best_state = {k[len("best/") :]: v for k, v in tensors.items() if k.startswith("best/")}
        self.epoch_loss = [float(meta["epoch_loss"][0]), int(meta["epoch_loss"][1])]

    # ---- logs -------------------------------------------------------------------------------------------

    def _log_step(self, rec: dict[str, float], images_per_s: float) -> None:
        if not self.dist.is_main:
            return
        row = {"step": int(rec["step"]), "loss": rec["loss"], "lr": rec["lr"], "grad_norm": rec["grad_norm"]}
        logs.append_csv(self.run_dir / "steps.csv", {**row, "images_per_s": round(images_per_s, 1)})
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm"):
                self._tb.add_scalar(f"train/{k}", rec[k], int(rec["step"]))
            self._tb.add_scalar("train/images_per_s", images_per_s, int(rec["step"]))

    def _log_epoch(self, row: dict[str, Any]) -> None:
        self.epoch_rows.append(row)
        if not self.dist.is_main:
            return
        logs.append_csv(self.run_dir / "metrics.csv", row)
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("epoch", "step") and isinstance(v, (int, float)) and v == v:
                    self._tb.add_scalar(f"epoch/{k}", v, int(row["step"]))

    def _open_logs(self, resumed: bool) -> None:
        if not self.dist.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        if resumed:  # drop what the interrupted run logged after its last checkpoint
            for name in ("steps.csv", "metrics.csv", "selection.csv"):
                logs.truncate_csv(self.run_dir / name, self.step)
            self.epoch_rows = logs.read_csv(self.run_dir / "metrics.csv")
        else:
            for name in ("steps.csv", "metrics.csv", "selection.csv"):
                (self.run_dir / name).unlink(missing_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=self.step if resumed else None)

    # ---- the loop ---------------------------------------------------------------------------------------

    def fit(
        self, resume: str | Path | None = None, *, on_step: Callable[[Trainer, dict[str, float]], None] | None = None
    ) -> TrainResult:
        """Train to ``total_steps``; ``on_step(trainer, record)`` is called after every step (tests, hooks)."""
        t0 = time.perf_counter()
        self._clean_after_kill()
        notes: list[str] = []
        if resume is not None:
            self.load_state(train_state.resolve_resume(resume))
        self._open_logs(resumed=resume is not None)  # config.json first: a stage-1 crash leaves a resumable run
        if resume is None and self.cfg.adapt.method == "lp-ft":
            notes.append(self._linear_probe_head())
        if self.select_set is not None and self.step == 0:
            self._select()  # step 0 is a candidate: for lp-ft, the linear head it starts from
        cfg, spe = self.cfg, self.loader.steps_per_epoch
        from tqdm import tqdm

        last_eval: dict[str, float] = {}
        epoch_t0, epoch_images = time.perf_counter(), 0
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (self.progress and self.dist.is_main),
            desc=cfg.name,
        )
        with heap_kept(), bar:  # freed activations stay in the heap for the next step (heap.py)
            while self.step < self.total_steps:
                epoch = self.step // spe
                t_last = time.perf_counter()
                for micro in self.loader.epoch(epoch, self.step % spe):
                    rec = self.train_step(micro)
                    self.history.append(rec)
                    if self.select_set is not None and (
                        self.step % self.select_every == 0 or self.step == self.total_steps
                    ):
                        self._select()
                    now = time.perf_counter()
                    ips = cfg.data.batch_size / max(now - t_last, 1e-9)
                    t_last = now
                    epoch_images += cfg.data.batch_size
                    bar.update(1)
                    if self.step % cfg.log_every_steps == 0 or self.step == self.total_steps:
                        bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", img_s=f"{ips:.0f}")
                        self._log_step(rec, ips)
                    every = cfg.checkpoint_every_steps
                    if every and self.step % every == 0 and self.step % spe and self.step < self.total_steps:
                        self.save_state()  # mid-epoch; epoch ends are checkpointed below, after the metrics
                    if on_step is not None:
                        on_step(self, rec)
                    if self.step >= self.total_steps:
                        break
                # end of an epoch (or of training)
                ep = (self.step - 1) // spe
                done = self.step >= self.total_steps
                due = done or (ep + 1) % cfg.eval_every_epochs == 0
                last_eval = self.evaluate() if due and self.select_set is None else {}  # selecting: after the loop
                seconds = time.perf_counter() - epoch_t0
                row = {
                    "epoch": ep + 1 if self.step % spe == 0 else round(self.step / spe, 3),
                    "step": self.step,
                    "train_loss": self.epoch_loss[0] / max(self.epoch_loss[1], 1),
                    "val_loss": last_eval.get("val_loss", float("nan")),
                    "val_top1": last_eval.get("val_top1", float("nan")),
                    "lr": self.opt.param_groups[0]["lr"],
                    "images_per_s": round(epoch_images / max(seconds, 1e-9), 1),
                    "skipped_steps": self.skipped,
                }
                self.epoch_loss = [0.0, 0]
                epoch_t0, epoch_images = time.perf_counter(), 0
                self._log_epoch(row)
                top1 = last_eval.get("val_top1")
                if top1 is not None and (self.best_top1 is None or top1 > self.best_top1):
                    self.best_top1 = top1
                    self.save_model("best", val_top1=top1)
                self.save_state()
        kept: dict[str, Any] = {}
        if self.select_set is not None:
            notes.append(self._keep_selected())
            last_eval = self.evaluate()
            kept = {"selected_step": self.best_step, "selected_top1": self.best_top1}
            kept["selected_on"] = self._select_name()
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
            ctx = self.ema.swapped_in(self.net) if self.ema is not None else contextlib.nullcontext()
            with ctx:
                self._best_state = self._full_model_state()

    def _keep_selected(self) -> str:
        """Put the selected weights back into the model (they are the EMA weights when EMA is on, so EMA is
        done with); returns the line that says which step was kept."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        assert self._best_state is not None and self.best_top1 is not None
        if self.best_step != self.step:
            state: dict[str, Any] = {k: v.to(self.device) for k, v in self._best_state.items()}
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
            self.net.set_fused_attention(True)  # features as every evaluation computes them (and caches them)
            fit = fit_linear_head(self)
            self.net.set_fused_attention(not self.explicit_attention)
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
        claim = False
    elif cfg is None:
        raise ConfigError("nothing to run: give a config or a run to resume")
    else:
        folder = Path(run_dir) if run_dir is not None else Path("runs") / cfg.name
        claim = "numbered" if run_dir is None else "exclusive"
    if cfg.adapt.method == "linear":  # no gradient steps: a head fitted on frozen features
        from vitkit.train.linear import LinearRun

        with LinearRun(cfg, folder, progress=progress, claim=claim) as run:
            return run.fit()
    with Trainer(cfg, folder, progress=progress, claim=claim) as trainer:
        return trainer.fit(state)


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
