"""The training configuration schema: typed dataclasses, serialisable to and from JSON (a run's config.json).

A recipe (``vitkit.configs.recipes``) is a function returning a :class:`TrainConfig`; the CLI applies a few
overrides (data, epochs, batch size, lr ...) with :meth:`TrainConfig.override`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from vitkit.errors import ConfigError

# AugReg ("How to train your ViT", Steiner et al. 2021) by level: RandAugment (layers, magnitude), Mixup alpha.
AUGREG_LEVELS: dict[str, tuple[int, float, float]] = {
    "none": (0, 0.0, 0.0),
    "light1": (2, 0.0, 0.0),  # magnitude 0 is not a no-op in TF's RandAugment (posterize, solarize...)
    "light2": (2, 10.0, 0.2),
    "medium1": (2, 15.0, 0.2),
    "medium2": (2, 15.0, 0.5),
    "strong1": (2, 20.0, 0.5),
    "strong2": (2, 20.0, 0.8),
}


@dataclass
class DataConfig:
    """The dataset of a run: source (see :func:`vitkit.data.datasets.open_dataset`), splits, input size and
    loader settings."""

    source: str = "digits"  # see vitkit.data.open_dataset
    train_split: str = "train"
    val_split: str | None = "auto"  # "auto": "val" if the source has one, else "test"; None: no evaluation
    image_size: tuple[int, int] = (224, 224)
    batch_size: int = 512  # global: across processes and accumulation steps
    eval_batch_size: int = 256  # per process
    workers: int = 4  # DataLoader worker processes per training process
    skip_bad: bool = False
    mean: tuple[float, ...] | None = None  # None: the checkpoint's when fine-tuning, else (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = None
    grayscale: bool | None = None  # single-channel models ("L" images); None: the checkpoint's, else False
    eval_resize: Literal["squash", "crop"] = "squash"  # official ViT: squash; timm/DeiT: crop
    eval_crop_pct: float = 1.0


@dataclass
class AugConfig:
    """Augmentation: crop, flip, RandAugment, Mixup/CutMix and label smoothing, or an AugReg level that sets
    them."""

    augreg: str | None = None  # an AugReg level; sets randaug_* and mixup (overriding them) when given
    crop: Literal["inception", "pad", "resize"] = "inception"
    crop_scale: tuple[float, float] = (0.05, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    pad: int = 0
    flip: bool = True
    randaug_layers: int = 0
    randaug_magnitude: float = 0.0
    randaug_ops: tuple[str, ...] | None = None  # a subset of the 16 ops (default: all)
    randaug_fill: int = 128  # value of pixels uncovered by rotate/shear/translate/cutout (TF: 128)
    mixup: float = 0.0  # Beta(alpha, alpha); 0 disables
    cutmix: float = 0.0
    mix_prob: float = 1.0
    mix_switch_prob: float = 0.5
    label_smoothing: float = 0.0
    interpolation: str = "bilinear"

    def resolved(self) -> AugConfig:
        """With the AugReg level (if any) applied to RandAugment and Mixup."""
        if self.augreg is None:
            return self
        if self.augreg not in AUGREG_LEVELS:
            raise ConfigError(f"unknown AugReg level {self.augreg!r}; choose from {', '.join(AUGREG_LEVELS)}")
        layers, magnitude, mixup = AUGREG_LEVELS[self.augreg]
        return dataclasses.replace(self, randaug_layers=layers, randaug_magnitude=magnitude, mixup=mixup)


@dataclass
class ModelConfig:
    """The model of a run: a paper variant with :class:`~vitkit.models.ViTConfig` overrides, and for
    fine-tuning the checkpoint to start from."""

    name: str | None = "Ti/16"  # a paper variant; None: every field from ``overrides`` (ViTConfig defaults)
    overrides: dict[str, Any] = field(default_factory=dict)  # any ViTConfig field: depth, dropout, drop_path...
    init_from: str | None = None  # fine-tuning: a checkpoint (any supported format) to start from
    pos_interpolation: str = "bilinear"  # resampling of the position-embedding grid when fine-tuning


@dataclass
class OptimConfig:
    """Optimiser and schedule: Adam/AdamW/SGD, learning rate, decoupled weight decay, warm-up then decay,
    clipping, gradient accumulation."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0  # decoupled (AdamW: p -= lr * wd * p); never on norms, biases, embeddings
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9  # SGD
    nesterov: bool = False
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0  # added to warmup_steps once the epoch length is known
    # a recipe's warm-up is sized for its own data set: on a run with fewer steps it takes at most this share of
    # the run's steps (scaled down, with a note; vitkit.train.optim.fitted_warmup); None: exactly as given
    warmup_max_fraction: float | None = 0.2
    end_lr: float = 0.0  # learning rate at the last step (linear / cosine)
    clip_norm: float | None = 1.0  # global gradient-norm clipping


ADAPT_METHODS = ("full", "linear", "lp-ft", "lora")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # the attention and MLP projections of every block


@dataclass
class AdaptConfig:
    """How a checkpoint is adapted to new classes (``vitkit finetune --method``).

    - ``full``: every weight trained, from a zero head (the paper's fine-tuning);
    - ``linear``: the backbone frozen, a multinomial logistic-regression head fitted on its pre-logits features
      (L2 strength ``l2``, or chosen on held-out training examples when None), no gradient steps;
    - ``lp-ft``: that head, then every weight trained from it (Kumar et al., ICLR 2022);
    - ``lora``: low-rank adapters (peft's format) on the blocks' ``lora_targets`` and the head trained, the rest frozen.
    """

    method: Literal["full", "linear", "lp-ft", "lora"] = "full"
    l2: float | None = None  # linear / lp-ft: mean cross-entropy + l2/2 ||W||^2; None: chosen on held-out data
    heldout_fraction: float = 0.2  # of every class's training examples, to choose l2 on (then refitted on all)
    feature_epochs: int = 0  # linear / lp-ft: extra feature passes through the training augmentation
    feature_cache: str | None = None  # folder of the feature cache; None: vitkit's cache dir (features/)
    feature_precision: Literal["fp32", "bf16", "int8"] = "fp32"  # linear / lp-ft: bf16, int8: the fast path
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    save_adapters: bool = False  # save the adapters and head apart from the base weights instead of merged
    # full / lp-ft / lora: evaluate on a validation split (the data set's own "val", else a stratified
    # ``val_fraction`` of the training split, not trained on) at step 0 and every ``eval_every_steps`` (None: a
    # twentieth of the run), keep the best weights, and save those as model/
    select: bool = False
    val_fraction: float = 0.1
    eval_every_steps: int | None = None

    def validate(self) -> None:
        if self.method not in ADAPT_METHODS:
            raise ConfigError(f"adapt.method: {self.method!r} is not one of {', '.join(ADAPT_METHODS)}")
        if self.l2 is not None and not (self.l2 > 0 and math.isfinite(self.l2)):
            raise ConfigError(f"adapt.l2 must be a positive number (or null: chosen on held-out data), got {self.l2}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError(f"adapt.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if isinstance(self.feature_epochs, bool) or not isinstance(self.feature_epochs, int) or self.feature_epochs < 0:
            raise ConfigError(f"adapt.feature_epochs must be a non-negative integer, got {self.feature_epochs!r}")
        if self.feature_precision not in ("fp32", "bf16", "int8"):
            raise ConfigError(f"adapt.feature_precision must be fp32, bf16 or int8, got {self.feature_precision!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise ConfigError(f"adapt.lora_rank must be a positive integer, got {self.lora_rank!r}")
        if not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise ConfigError(f"adapt.lora_alpha must be a positive number, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"adapt.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"adapt.val_fraction must be in (0, 1), got {self.val_fraction}")
        n = self.eval_every_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"adapt.eval_every_steps must be a positive integer or null, got {n!r}")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets:
            raise ConfigError(
                f"adapt.lora_targets: {unknown[0] if unknown else 'none given'}; choose from {', '.join(LORA_TARGETS)}"
            )


@dataclass
class TrainConfig:
    """A whole training run (``vitkit train``): data, augmentation, model, optimiser and the loop's settings.
    Recipes (:func:`vitkit.configs.get_recipe`) return one; ``--set KEY=VALUE`` overrides any field."""

    name: str = "run"
    recipe: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)  # fine-tuning method (full by default)
    epochs: float | None = 10  # training length: epochs, or ``steps`` when set (steps win)
    steps: int | None = None
    accum_steps: int = 1
    loss: Literal["softmax", "sigmoid"] = "softmax"
    # bf16: autocast for forward/backward, fp32 master weights; auto: bf16 on a GPU that computes it, else fp32
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    compile: bool = False
    # fp32 matmuls on TF32 tensor cores where the GPU has them (Ampere and later); false: full fp32 everywhere
    # (cuDNN's TF32 convolutions off too), for runs that must match another device's fp32 to rounding
    tf32: bool = True
    grad_checkpointing: bool = False  # recompute block activations in the backward pass (less memory)
    # attention kernel of training steps: "auto" = the explicit softmax on CPU (its backward is faster than
    # PyTorch's fused CPU kernel) unless its stored probabilities would pass 1 GiB, else fused SDPA (flash,
    # and always on GPU); the same function either way. Evaluation always runs the fused kernel. "measure": on CPU,
    # race vitkit's C kernels, PyTorch's explicit softmax and SDPA on one block and keep the fastest
    # (vitkit.train.training_path; for AMX Xeons) -- not the default, since a timing race could give two runs of
    # one seed different kernels and so different rounding
    attention: Literal["auto", "fused", "explicit", "measure"] = "auto"
    ema_decay: float | None = None  # Polyak averaging of weights (0.9999 in the paper's best runs)
    ema_warmup: bool = False  # decay min(ema_decay, (1 + step) / (10 + step)) early on
    seed: int = 0
    eval_every_epochs: int = 1
    checkpoint_every_steps: int | None = None  # also checkpoint mid-epoch (besides every epoch end)
    keep_last: int = 2
    skip_nonfinite: bool = False  # skip (and count) steps with a non-finite loss/gradient instead of stopping
    distributed: Literal["ddp", "fsdp"] = "ddp"  # strategy under torchrun (FSDP2 shards params per block)
    device: str = "auto"  # "auto": cuda when available, else cpu
    log_every_steps: int = 10

    # ---- (de)serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, d, "config")

    def override(self, **changes: Any) -> TrainConfig:
        """A copy with dotted-path fields changed: ``cfg.override(**{"optim.lr": 3e-3, "epochs": 5})``."""
        d = self.to_dict()
        for path, value in changes.items():
            node = d
            *parents, leaf = path.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    raise ConfigError(f"unknown config field {path!r}")
                node = node[p]
            if leaf not in node:
                raise ConfigError(f"unknown config field {path!r}")
            node[leaf] = _to_jsonable(value)
        return TrainConfig.from_dict(d)

    def validate(self) -> None:
        if self.steps is None and (self.epochs is None or self.epochs <= 0):
            raise ConfigError("set a positive number of epochs or steps")
        if self.steps is not None and self.steps <= 0:
            raise ConfigError(f"steps must be positive, got {self.steps}")
        if self.accum_steps < 1 or self.data.batch_size < 1:
            raise ConfigError("batch size and accumulation steps must be positive")
        if self.optim.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.optim.lr}")
        self._validate_positive()
        f = self.optim.warmup_max_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise ConfigError(f"optim.warmup_max_fraction must be in (0, 1] or null, got {f}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        from vitkit.hardware import WORKERS_PER_CORE, max_workers  # torch: only once a run is validated

        workers, most = self.data.workers, max_workers()
        if isinstance(workers, bool) or not isinstance(workers, int) or not 0 <= workers <= most:
            raise ConfigError(
                f"data.workers must be an integer in 0..{most} ({WORKERS_PER_CORE} per core here), got {workers!r}"
            )
        self.aug.resolved()
        self.adapt.validate()
        if self.adapt.method != "full" and not self.model.init_from:
            raise ConfigError(f"adapt.method {self.adapt.method}: adapts a checkpoint; set model.init_from")

    def _validate_positive(self) -> None:
        """The counts and sizes a run divides by or steps with: positive (0 would divide by zero)."""
        for name, value in (("log_every_steps", self.log_every_steps), ("eval_every_epochs", self.eval_every_epochs),
                            ("checkpoint_every_steps", self.checkpoint_every_steps)):  # fmt: skip
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not self.optim.eps > 0:
            raise ConfigError(f"optim.eps must be positive, got {self.optim.eps}")
        if not all(0.0 <= b < 1.0 for b in self.optim.betas) or len(self.optim.betas) != 2:
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(self.optim.betas)}")


def _to_jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    return x


def _from_dict(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {k: coerce(hints[k], v, f"{where}.{k}") for k, v in d.items()}
    return cls(**kwargs)


def coerce(tp: Any, v: Any, where: str) -> Any:
    """A JSON (or Python) value -> the annotated type (nested dataclasses, tuples from lists, Optional), or a
    ConfigError naming ``where``: the one type check of config values, for config.json, ``override`` and the
    named options of :func:`vitkit.configs.apply_overrides`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in typing.get_args(tp):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, v, where)  # type: ignore[arg-type]
    if origin is Literal and v not in typing.get_args(tp):
        choices = ", ".join(repr(c) for c in typing.get_args(tp))
        raise ConfigError(f"{where}: {v!r} is not one of {choices}")
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {v!r}")
        if any(isinstance(x, float) and not math.isfinite(x) for x in v):
            raise ConfigError(f"{where}: expected finite numbers, got {list(v)!r}")
        return tuple(v)
    if (origin is dict or tp is dict) and not isinstance(v, dict):
        raise ConfigError(f"{where}: expected an object, got {v!r}")
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp is float and isinstance(v, float) and not math.isfinite(v):  # NaN passes every comparison's refusal
        raise ConfigError(f"{where}: expected a finite number, got {v!r}")
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp)
    if expected and not (isinstance(v, tp) and (tp is bool or not isinstance(v, bool))):
        raise ConfigError(f"{where}: expected {expected}, got {v!r}")
    return v
