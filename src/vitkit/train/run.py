"""What every training run has, whatever trains it (:class:`Run`): the config, the process group and device,
the run folder (claimed before any work: :func:`check_run_dir`), the data, the model built for it, saving, and
clean-up; and what :func:`vitkit.train.train` returns (:class:`TrainResult`). :class:`vitkit.train.trainer.Trainer`
adds the gradient steps, ``vitkit.train.linear.LinearRun`` fits a linear head in closed form instead; both import
this module, which imports neither.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from vitkit.checkpoints import load_checkpoint, lora_format, vitkit_format
from vitkit.checkpoints.loaded import empty_model, state_digest
from vitkit.configs import TrainConfig
from vitkit.data.datasets import open_dataset, open_split_or_none
from vitkit.data.image_dataset import ImageDataset, note_skipped, split_candidates
from vitkit.data.subset import split_off
from vitkit.errors import ConfigError, VitkitError
from vitkit.fileio import clean_stale, refuse_link, remove_tree
from vitkit.hardware import restore_tf32, use_tf32
from vitkit.inference.policy import train_precision
from vitkit.models.lora import LoraSpec, add_lora, merge_lora
from vitkit.output_paths import check_output_location
from vitkit.train import build
from vitkit.train import parallel as distr
from vitkit.train import state as train_state
from vitkit.train.ema import EMA


@dataclass
class TrainResult:
    """What :func:`vitkit.train.train` returns: the run folder, the last optimiser step, the per-step log (step, loss,
    learning rate) and the per-epoch metrics (the rows of ``metrics.csv``)."""

    run_dir: Path
    step: int
    steps: list[dict[str, float]] = field(default_factory=list)  # per optimiser step: step, loss, lr
    epochs: list[dict[str, Any]] = field(default_factory=list)  # the metrics.csv rows
    final_top1: float | None = None  # validation top-1 of the saved model (final / EMA weights)
    best_top1: float | None = None
    skipped_steps: int = 0
    seconds: float = 0.0
    val_split: str | None = None  # which split final_top1 was measured on
    final_metrics: dict[str, float] = field(default_factory=dict)
    rank: int = 0  # the process that produced this result (only process 0 writes and prints)
    notes: list[str] = field(default_factory=list)  # e.g. how a linear head's L2 strength was chosen
    val_precision: str | None = None  # what final_top1 was computed in: "fp32", "bf16" or "int8"
    selected_step: int | None = None  # adapt.select: the step whose weights model/ holds

    def summary(self) -> str:
        """The lines ``vitkit train`` prints at the end."""
        lines = list(self.notes)
        if self.final_top1 is not None:
            n = int(self.final_metrics.get("val_count", 0))
            how = f", computed in {self.val_precision}" if self.val_precision else ""
            lines.append(
                f"{self.val_split} accuracy: {100 * self.final_top1:.2f}% ({round(self.final_top1 * n)}/{n}){how}"
            )
        if self.skipped_steps:
            lines.append(f"skipped {self.skipped_steps} steps with a non-finite loss or gradient")
        lines.append(f"run folder: {self.run_dir} ({self.step} steps, {self.seconds:.1f} s)")
        return "\n".join(lines)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for the global torch RNG at ``step`` (dropout, stochastic depth)."""
    return int(np.random.SeedSequence([seed, step, rank, 0x70C4]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class Run:
    """What every run has, whatever trains it: the config, the process group and device, the run folder, the
    data, the model built for it (with its preprocessing), saving the model, and clean-up. :class:`Trainer`
    adds the gradient steps; ``vitkit.train.linear.LinearRun`` fits a linear head in closed form instead."""

    ema: EMA | None = None

    def __init__(
        self, cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, claim: bool | str = "exclusive"
    ) -> None:
        """``claim``: "exclusive" -- ``run_dir`` must not hold a run yet; "numbered" -- use ``run_dir-2``,
        ``-3``... when taken; False -- use it as is (resuming)."""
        cfg.validate()
        self.cfg = cfg
        self.progress = progress
        self.dist = distr.setup(cfg.device)
        self.device = self.dist.device
        self.precision = train_precision(cfg.precision, self.device)  # "auto" resolved: "fp32" or "bf16"
        self._tf32 = use_tf32(self.device, cfg.tf32)  # TF32 for fp32 matmuls where the GPU has it; undone on close
        self.run_dir = self._claim(Path(run_dir), claim) if claim else Path(run_dir)
        # a new run's folders not there yet (the run folder, then its missing parents): what a run that fails
        # before its first training state removes again, with the files it wrote there (_remove_unfinished)
        self._new_dirs = _missing_dirs(self.run_dir) if claim and self.dist.is_main else None
        self.step = 0
        self._tb: Any = None
        self._sigterm: distr.StopSignal | None = None

        # loader workers per process: a recipe's 8 on a 2-core machine are 2; N processes share the cores
        self.workers = min(cfg.data.workers, max(1, (os.cpu_count() or 1) // self.dist.local_world))
        self.train_set, self.val_set = self._open_data()
        for ds in (self.train_set, self.val_set):
            if ds is not None and self.dist.is_main:
                note_skipped(ds)
        self.select_set: ImageDataset | None = None  # the split the weights are selected on (adapt.select)
        if cfg.adapt.select and cfg.adapt.method != "linear":
            self.train_set, self.select_set = self._selection_split(self.train_set, self.val_set)
        self.classes = self.train_set.classes
        net, self.preprocess = build.build_model(cfg, self.classes)
        self.lora: LoraSpec | None = None
        self._base_digest_value: str | None = None
        if cfg.adapt.method == "lora":  # adapters in place (drawn from the seed), all else but the head frozen
            if cfg.distributed == "fsdp" and self.dist.enabled:
                raise ConfigError(
                    "adapt.method lora: train with distributed=ddp (FSDP shards frozen and trained weights alike)"
                )
            a = cfg.adapt
            self.lora = LoraSpec(a.lora_rank, a.lora_alpha, a.lora_dropout, a.lora_targets)
            add_lora(net, self.lora, seed=cfg.seed)
        self.net = net.to(self.device)  # the bare model (FSDP shards it in place)

    # ---- setup -----------------------------------------------------------------------------------------

    def _claim(self, base: Path, mode: bool | str) -> Path:
        """Pick the run folder on process 0 and share the choice (a number, no pickle) with the others."""
        n = 0
        check_run_dir(base, numbered=True)  # what cannot be a run folder, whatever its number
        if self.dist.is_main:
            if mode == "numbered":
                while _taken(base if n == 0 else base.with_name(f"{base.name}-{n}")):
                    n = max(n + 1, 2)
            elif _taken(base):
                n = -1
        n = distr.broadcast_int(n, self.dist)
        if n < 0:
            check_run_dir(base, numbered=False)  # says why
            raise ConfigError(f"{base}: taken by a run or a run's files; choose another --out")
        return base if n == 0 else base.with_name(f"{base.name}-{n}")

    def _open_data(self) -> tuple[ImageDataset, ImageDataset | None]:
        d = self.cfg.data
        train = open_dataset(d.source, d.train_split, skip_bad=d.skip_bad)
        if d.val_split is None:
            return train, None
        if d.val_split == "auto":
            for split in ("val", "test"):
                val = open_split_or_none(d.source, split, skip_bad=d.skip_bad, classes=train.classes)
                if val is not None:
                    return train, val
            return train, None
        return train, open_dataset(d.source, d.val_split, skip_bad=d.skip_bad, classes=train.classes)

    def _selection_split(
        self, train: ImageDataset, val: ImageDataset | None
    ) -> tuple[ImageDataset, ImageDataset | None]:
        """(what to train on, what to select the weights on): the data set's own validation split with all of
        train, else a stratified ``adapt.val_fraction`` of train (drawn from the seed) and the rest of it. Never
        the test split: the selected model is then measured there."""
        d = self.cfg.data
        own = val if val is not None and val.split in split_candidates("val") else None
        if own is None:
            own = open_split_or_none(d.source, "val", skip_bad=d.skip_bad, classes=train.classes)
        if own is not None:
            return train, own
        parts = split_off(train, self.cfg.adapt.val_fraction, self.cfg.seed)
        if parts is None:
            if self.dist.is_main:
                print(
                    "note: a class has a single training example and the data set has no validation split: nothing "
                    "to select the weights on; the last step's are kept",
                    file=sys.stderr,
                )
            return train, None
        return parts

    # ---- saving ---------------------------------------------------------------------------------------

    def _full_model_state(self, trained_only: bool = False) -> dict[str, torch.Tensor]:
        """Every weight of the model, copied to the CPU (the full tensors, on process 0 when sharded);
        ``trained_only``: only the parameters that train (LoRA's adapters and head, not the frozen base)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        keep = {n for n, p in self.net.named_parameters() if p.requires_grad} if trained_only else sd.keys()
        # copies: on one process these would alias the parameters (and change when EMA weights swap out)
        return {k: v.detach().clone() for k, v in sd.items() if isinstance(v, torch.Tensor) and k in keep}

    def ema_weights(self) -> contextlib.AbstractContextManager[None]:
        """The EMA (Polyak-averaged) weights in the model for a ``with`` block, the trained ones back after it;
        nothing changes without EMA. What validation, the selected step and the saved model use."""
        return self.ema.swapped_in(self.net) if self.ema is not None else contextlib.nullcontext()

    def save_model(self, folder: str, **provenance: Any) -> None:
        """The current weights (EMA when on) as a vitkit folder (``model/`` or ``best/``)."""
        with self.ema_weights():
            state = self._full_model_state()
        if self.dist.is_main:
            model = empty_model(self.net.cfg)
            if self.lora is not None:
                add_lora(model, self.lora)
            model.load_state_dict(state, strict=True)
            prov = {"recipe": self.cfg.recipe, "run": str(self.run_dir), "step": self.step, **provenance}
            if self.cfg.model.init_from:
                prov["fine_tuned_from"] = self.cfg.model.init_from
                prov["method"] = self.cfg.adapt.method
            if self.lora is not None:
                prov["lora"] = self.lora.to_dict()
            if self.lora is not None and self.cfg.adapt.save_adapters:
                assert self.cfg.model.init_from  # validate(): adaptation starts from a checkpoint
                lora_format.save(
                    model,
                    self.run_dir / folder,
                    base=self.cfg.model.init_from,
                    base_digest=self._base_digest(),
                    spec=self.lora,
                    pos_interpolation=self.cfg.model.pos_interpolation,
                    preprocess=self.preprocess,
                    class_names=self.classes,
                    provenance=prov,
                    overwrite=True,
                )
            else:
                vitkit_format.save(
                    merge_lora(model) if self.lora is not None else model,
                    self.run_dir / folder,
                    preprocess=self.preprocess,
                    class_names=self.classes,
                    provenance=prov,
                    overwrite=True,  # the run's own model/ or best/, replaced as training goes on
                )
        distr.barrier(self.dist)

    def _base_digest(self) -> str:
        """``state_digest`` of the checkpoint fine-tuning started from, as loaded (its resolution and head)."""
        if self._base_digest_value is None:
            assert self.cfg.model.init_from
            self._base_digest_value = state_digest(load_checkpoint(self.cfg.model.init_from).model.state_dict())
        return self._base_digest_value

    def _clean_after_kill(self) -> None:
        """Restore or remove what a killed run left in its folder (only vitkit's own hidden temporaries and
        incomplete ``step-N/`` folders), before anything reads it."""
        if self.dist.is_main:
            done = clean_stale(self.run_dir, ("model", "best"))
            done += train_state.clean_states(self.run_dir / "checkpoints")
            for note in done:
                print(f"note: {self.run_dir}: {note} (left by an interrupted run)", file=sys.stderr)
        distr.barrier(self.dist)

    def close(self, clean: bool = True) -> None:
        """Release the TensorBoard writer and the process group (``clean=False`` after an error)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        distr.teardown(self.dist, clean)
        if self._sigterm is not None:
            self._sigterm.release()
        restore_tf32(self._tf32)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        if self._sigterm is not None:
            self._sigterm.stop()  # no SIGTERM while the other processes are told (distributed.py)
        peer = distr.FailureNotice(self.dist, exc).peer  # set when another process failed first
        if self._sigterm is not None:  # torchrun's SIGTERM must not cut its report short
            self._sigterm.release(keep_holding=peer is not None)
        self.close(clean=False)
        if isinstance(exc, VitkitError):  # refused for its input; an interrupted run stays, to be resumed
            self._remove_unfinished()
        if peer is not None:
            raise peer from None

    def _remove_unfinished(self) -> None:
        """After a new run failed (its data, a setting) before it wrote a training state or its model, remove what
        it wrote -- the names of RUN_ENTRIES in its folder, none of which was there when it claimed the folder --
        and the folders it created, when they are then empty: nothing is left to resume, and the same command
        run again gets the same folder (not ``runs/<name>-2``). Anything else in the folder stays."""
        if self._new_dirs is None or not self.run_dir.is_dir():
            return
        if train_state.list_states(self.run_dir / "checkpoints") or (self.run_dir / "model").exists():
            return  # resumable, or finished: kept
        train_state.clean_states(self.run_dir / "checkpoints")  # vitkit's own temporaries of a cut-short save
        clean_stale(self.run_dir, ("model", "best"))
        remove_run_entries(self.run_dir)
        for folder in self._new_dirs:  # the run folder first, then the parents it created
            try:
                folder.rmdir()
            except OSError:  # holds something vitkit did not write: left as it is
                break


# what a run writes in its folder: a folder holding any of these is taken (a run, or a user's files of those names,
# which a run would overwrite or, steps.csv and metrics.csv, delete at its start)
RUN_ENTRIES = (
    "checkpoints",
    "model",
    "best",
    "metrics.csv",
    "steps.csv",
    "config.json",
    "curves.png",
    "tb",
    "probe.json",  # finetune --method linear / lp-ft
    "selection.csv",  # finetune --method full / lp-ft / lora: the held-out evaluations the weights are chosen by
)


def remove_run_entries(run_dir: Path) -> None:
    """Remove what a run wrote in ``run_dir``: the names of RUN_ENTRIES (a link itself, never what it points at)."""
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            remove_tree(path)
        elif path.is_file() or path.is_symlink():
            path.unlink(missing_ok=True)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, nearest first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink() or p == Path(p.anchor or "."):
            break
        missing.append(p)
    return missing


def _taken(path: Path) -> bool:
    return any((path / name).exists() or (path / name).is_symlink() for name in RUN_ENTRIES)


def check_run_links(path: Path) -> None:
    """Refuse to resume a run where any file a run writes in its folder (RUN_ENTRIES) is a symbolic link
    (dangling or not): vitkit never writes through one. One line naming it, before any work."""
    for name in RUN_ENTRIES:
        refuse_link(path / name, "--resume")


def check_run_dir(path: Path, numbered: bool = False) -> None:
    """Refuse a run folder training cannot use, before any work (``vitkit train``/``finetune`` ask before loading
    data or a checkpoint): a file where it (or a folder above it) should be, a place that cannot be written, and
    -- unless ``numbered`` (the default runs/<name>, which moves on to runs/<name>-2 ...) -- a folder holding a run
    or files a run writes (RUN_ENTRIES), which a run would overwrite."""
    for p in (path, *path.parents):  # a file where the run folder (or a folder above it) should be
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{p}: exists and is not a folder; choose another run folder (--out)")
    check_output_location(path, inside=True)
    if numbered:
        return
    if any((path / name).exists() for name in ("checkpoints", "model", "metrics.csv", "config.json")):
        raise ConfigError(
            f"{path} already holds a run; continue it with: vitkit train --resume {path} (a run stopped before its "
            "first checkpoint starts again from step 0), or choose another --out"
        )
    found = [name for name in RUN_ENTRIES if (path / name).exists() or (path / name).is_symlink()]
    if found:
        raise ConfigError(
            f"{path}: holds {found[0]!r}, which a run would overwrite; choose an empty or new --out folder "
            "(vitkit never overwrites what it did not write)"
        )
