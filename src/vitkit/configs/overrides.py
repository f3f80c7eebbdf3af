"""Changing a recipe's config: typed ``--set KEY=VALUE`` and the command line's few named options.

Every value is checked against the schema's annotation (``TrainConfig`` and, under ``model.overrides.``,
``ViTConfig``): ``--set optim.lr=abc`` is a one-line error naming the key, never a crash later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from vitkit.configs.recipes import finetune_for_data, get_recipe
from vitkit.configs.schema import AdaptConfig, TrainConfig, coerce
from vitkit.errors import ConfigError
from vitkit.models.vit import ViTConfig

ARCHITECTURE_FIELDS = ("patch_size", "hidden_size", "depth", "num_heads", "mlp_dim")
PRETRAIN_RESOLUTION = 224  # the paper pre-trains at 224 px; fine-tuning recipes' sizes are relative to it
MODEL_OVERRIDES = "model.overrides."


def field_type(path: str) -> Any:
    """The annotation of a dotted config field (``optim.lr`` -> float; ``model.overrides.depth`` -> int)."""
    if path.startswith(MODEL_OVERRIDES):
        name = path[len(MODEL_OVERRIDES) :]
        hints = typing.get_type_hints(ViTConfig)
        if name not in hints or "." in name:
            raise ConfigError(f"unknown model field {name!r} (--set {path}=...)")
        return hints[name]
    tp: Any = TrainConfig
    for part in path.split("."):
        if not dataclasses.is_dataclass(tp) or part not in (hints := typing.get_type_hints(tp)):
            raise ConfigError(f"unknown config field {path!r}")
        tp = hints[part]
    return tp


def parse_value(tp: Any, text: str, key: str) -> Any:
    """Command-line text -> a value of annotation ``tp``; ConfigError naming ``key`` when it is not one."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"--set {key}={text}: expected {expected}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("null", "none") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return parse_value(inner[0] if len(inner) == 1 else Any, text, key)
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise bad("true or false")
    if tp is int or tp is float:
        try:
            return tp(text)
        except ValueError:
            raise bad("an integer" if tp is int else "a number") from None
    if tp is str:
        return _json_string(text)
    if origin is Literal:
        value = _json_string(text)
        if value not in args:
            raise bad("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin is tuple:
        parts = _json_list(text)
        if parts is None:
            parts = [p for p in text.replace(",", " ").split()]
        item_types = [args[0]] * len(parts) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(parts) == 1 and len(item_types) > 1 and len(set(item_types)) == 1:
            parts = parts * len(item_types)  # "224" -> (224, 224)
        if len(parts) != len(item_types):
            raise bad(f"{len(item_types)} values")
        return tuple(parse_value(t, str(p), key) for t, p in zip(item_types, parts, strict=True))
    if origin is dict or tp is dict:
        try:
            value = json.loads(text)
        except ValueError:
            raise bad("a JSON object") from None
        if not isinstance(value, dict):
            raise bad("a JSON object")
        return value
    try:  # Any
        return json.loads(text)
    except ValueError:
        return text


def _json_string(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        with contextlib.suppress(ValueError):
            return str(json.loads(text))
    return text


def _json_list(text: str) -> list[Any] | None:
    if not text.strip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """["optim.lr=3e-3", "model.overrides.depth=6"] -> {"optim.lr": 0.003, "model.overrides.depth": 6}, each
    value typed by the schema."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = parse_value(field_type(key), text, key)
    return out


def apply_overrides(cfg: TrainConfig, changes: Mapping[str, Any] = {}, sets: Sequence[str] = ()) -> TrainConfig:
    """``cfg`` with named options changed (dotted fields, e.g. from ``vitkit train``'s flags), then ``--set``.

    A named variant (``model.name``) replaces the recipe's architecture (its regularisation overrides stay);
    ``epochs`` replaces the recipe's length unless ``steps`` is given too.
    """
    changes = {k: v for k, v in changes.items() if v is not None}
    if "model.name" in changes and "model.overrides" not in changes:
        kept = {k: v for k, v in cfg.model.overrides.items() if k not in ARCHITECTURE_FIELDS}
        changes["model.overrides"] = kept
    if "epochs" in changes:
        changes.setdefault("steps", None)
    changes.update(shortened_warmup(cfg, changes.get("epochs"), changes.get("steps")))
    for key, value in changes.items():
        if value is not None:  # the schema's one check, naming the option's field (the CLI's types did it too)
            coerce(field_type(key), value, key)
    cfg = cfg.override(**changes)
    parsed = parse_sets(sets)
    model_fields = {k[len(MODEL_OVERRIDES) :]: v for k, v in parsed.items() if k.startswith(MODEL_OVERRIDES)}
    parsed = {k: v for k, v in parsed.items() if not k.startswith(MODEL_OVERRIDES)}
    if model_fields:
        parsed["model.overrides"] = {**parsed.get("model.overrides", cfg.model.overrides), **model_fields}
    return cfg.override(**parsed)


def finetune_config(
    checkpoint: str,
    data: str,
    recipe: str | None = None,
    image_size: tuple[int, int] | None = None,
    *,
    method: str = "full",
    notes: list[str] | None = None,
    skip_bad: bool = False,
) -> TrainConfig:
    """A fine-tuning run starting from ``checkpoint`` on ``data`` (``vitkit finetune``).

    ``recipe`` None (the command's default): the schedule sized by the number of training images
    (:func:`vitkit.configs.recipes.finetune_for_data`) at the checkpoint's own resolution unless ``image_size``;
    the line that says what was chosen and why is appended to ``notes`` (the CLI prints it). A named recipe is
    kept as it is; without an image size its resolution relative to the paper's 224 px pre-training (384 px for
    ``paper-finetune``: x 384/224) is applied to the checkpoint's own resolution and rounded to its stride --
    224 -> 384 px for a paper checkpoint, 16 -> 28 px for the digits model (384 px would be 9,216 tokens
    there) -- never above the larger of the checkpoint's and the recipe's resolution. ``method`` linear (a head
    on frozen features, nothing to adapt to a new resolution): the checkpoint's own resolution. Methods that
    train select their weights on held-out data (``adapt.select``). ``skip_bad``: the data is counted as the run
    will open it (unreadable items and empty class folders left out). An ``image_size`` the checkpoint's patch
    stride does not divide is refused here (ConfigError naming ``--image-size``), before any run folder exists.
    """
    from vitkit.checkpoints import read_checkpoint

    if image_size is not None:
        check_image_size(image_size, read_checkpoint(checkpoint).cfg, checkpoint)
    if recipe is None:
        native = read_checkpoint(checkpoint).cfg.image_size
        trained, held = training_images(data, AdaptConfig().val_fraction, select=method != "linear", skip_bad=skip_bad)
        cfg, why = finetune_for_data(trained, image_size or native, checkpoint, data, method)
        if notes is not None and method != "linear":
            notes.append(schedule_line(cfg, trained, held, native, why))
    else:
        cfg = get_recipe(recipe)
        if not cfg.model.init_from and cfg.model.name is not None:
            raise ConfigError(f"recipe {recipe!r} trains from scratch; use a fine-tuning recipe (paper-finetune, ...)")
    if image_size is None and method == "linear":
        image_size = read_checkpoint(checkpoint).cfg.image_size
        if notes is not None:
            notes.append(
                f"linear head on the checkpoint's own {image_size[0]}x{image_size[1]} px features; --image-size to "
                "choose"
            )
    elif image_size is None and recipe is not None:
        ckpt_cfg = read_checkpoint(checkpoint).cfg
        image_size = finetune_image_size(ckpt_cfg.image_size, ckpt_cfg.stride, cfg.data.image_size)
        if notes is not None:
            (h, w), (rh, rw) = ckpt_cfg.image_size, cfg.data.image_size
            notes.append(
                f"fine-tuning at {image_size[0]}x{image_size[1]} px: the checkpoint's {h}x{w} px scaled as recipe "
                f"{recipe} scales the paper's {PRETRAIN_RESOLUTION} px ({rh}x{rw}); --image-size to choose"
            )
    changes: dict[str, Any] = {"model.init_from": checkpoint, "data.source": data}
    if image_size is not None:
        changes["data.image_size"] = image_size
    if method != "full":
        changes.update({"adapt.method": method, "name": f"{cfg.name}-{method}"})
    if method != "linear":
        changes["adapt.select"] = True
    return cfg.override(**changes)


def check_image_size(image_size: tuple[int, int], ckpt: ViTConfig, checkpoint: str) -> None:
    """Refuse a fine-tuning resolution the checkpoint's patch stride does not divide (ConfigError naming
    ``--image-size``)."""
    stride = ckpt.stride
    h, w = image_size
    if h % stride or w % stride:
        what = "patch size" if ckpt.resnet_layers is None else "stride (ResNet x patch)"
        near = f"{max(1, round(h / stride)) * stride}" + ("" if h == w else f"x{max(1, round(w / stride)) * stride}")
        raise ConfigError(
            f"--image-size {h}x{w}: not a multiple of the {what} {stride} of {checkpoint}; choose a multiple of "
            f"{stride} (e.g. --image-size {near})"
        )


def training_images(data: str, val_fraction: float, *, select: bool, skip_bad: bool = False) -> tuple[int, int]:
    """(images trained on, images held out of them to select the weights on) of ``data``'s training split: a
    data set with a validation split of its own is trained on whole; else ``val_fraction`` of every class of at
    least two images is held out (``vitkit.data.subset``, as the run draws it). ``skip_bad``: what the listing
    shows unreadable (empty files and class folders) left out, as the run leaves it out; the images are not
    decoded here."""
    from vitkit.data.datasets import open_dataset, open_split_or_none
    from vitkit.data.subset import holdout_count

    train = open_dataset(data, "train", skip_bad=skip_bad, predecode=False)
    n = len(train)
    if (
        not select
        or open_split_or_none(data, "val", skip_bad=skip_bad, classes=train.classes, predecode=False) is not None
    ):
        return n, 0
    counts = np.bincount(train.labels, minlength=train.num_classes)
    if n == 0 or counts.min() < 2:
        return n, 0
    held = sum(holdout_count(int(c), val_fraction) for c in counts)
    return n - held, held


def schedule_line(cfg: TrainConfig, trained: int, held: int, native: tuple[int, int], why: str) -> str:
    """The one line ``vitkit finetune`` prints about the schedule it chose from the data."""
    batch = cfg.data.batch_size
    per_epoch = max(1, trained // batch)
    if cfg.steps is not None:
        length = f"{cfg.steps:,} steps of batch {batch} ({cfg.steps / per_epoch:.1f} epochs)"
        warm = f"{cfg.optim.warmup_steps} steps"
    else:
        epochs = cfg.epochs or 0.0
        length = f"{epochs:g} epochs = {round(epochs * per_epoch):,} steps of batch {batch}"
        warm = f"{round(cfg.optim.warmup_epochs * per_epoch)} steps"
    h, w = cfg.data.image_size
    res = "the checkpoint's own" if (h, w) == tuple(native) else f"the checkpoint's is {native[0]}x{native[1]}"
    kept = f"; {held} more held out to select the weights on" if held else ""
    return (
        f"schedule: {length}, warm-up {warm}, lr {cfg.optim.lr:g} ({cfg.optim.name}, {cfg.optim.schedule}), "
        f"{h}x{w} px ({res}); {why}{kept}. --recipe paper-finetune for the paper's recipe; --epochs, --steps, "
        "--batch-size, --lr, --image-size replace these"
    )


def finetune_image_size(native: tuple[int, int], stride: int, recipe_size: tuple[int, int]) -> tuple[int, int]:
    """The default fine-tuning resolution for a checkpoint trained at ``native`` (see :func:`finetune_config`)."""
    # one scale for both sides (the aspect ratio is kept): the recipe's over 224 px, capped per side
    scale = min(min(t / PRETRAIN_RESOLUTION, max(n, t) / n) for n, t in zip(native, recipe_size, strict=True))
    h, w = (max(1, round(n * scale / stride)) * stride for n in native)
    return h, w


def shortened_warmup(cfg: TrainConfig, epochs: float | None, steps: int | None) -> dict[str, Any]:
    """The warm-up overrides for a run whose length ``--epochs`` / ``--steps`` replace: a recipe's warm-up is
    sized for its own length, so a shorter run keeps the same fraction of warm-up (a 15-step fine-tune of the
    500-step recipe warms up for 3 steps, not 100 -- its learning rate then decays as the recipe intends).
    A longer run keeps the recipe's warm-up. When the lengths are in different units and the warm-up is in the
    recipe's other unit (10k steps in a 90-epoch recipe, run for 100 steps), the proportion needs the epoch
    length, known only when the data is opened: the trainer then says so if warm-up fills the run."""
    o = cfg.optim
    if not (o.warmup_steps or o.warmup_epochs) or (epochs is None and steps is None):
        return {}
    new_unit, new = ("steps", float(steps)) if steps is not None else ("epochs", float(epochs or 0))
    old_unit, old = ("steps", cfg.steps) if cfg.steps is not None else ("epochs", cfg.epochs)
    if not old or old <= 0 or new <= 0:
        return {}
    if new_unit == old_unit:
        f = new / old
        if f >= 1:
            return {}
        return {"optim.warmup_steps": round(o.warmup_steps * f), "optim.warmup_epochs": o.warmup_epochs * f}
    if old_unit == "epochs" and o.warmup_steps == 0:  # warm-up in epochs of an epoch recipe, run in steps
        return {"optim.warmup_steps": round(o.warmup_epochs / old * new), "optim.warmup_epochs": 0.0}
    if old_unit == "steps" and o.warmup_epochs == 0:  # warm-up in steps of a step recipe, run in epochs
        return {"optim.warmup_steps": 0, "optim.warmup_epochs": o.warmup_steps / old * new}
    return {}
