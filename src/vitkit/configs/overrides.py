"""Changing a recipe's config: typed ``--set KEY=VALUE`` and the command line's few named options.

Every value is checked against the schema's annotation (``TrainConfig`` and, under ``model.overrides.``,
``ViTConfig``): ``--set optim.lr=abc`` is a one-line error naming the key, never a crash later.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from vitkit.configs.recipes import get_recipe
from vitkit.configs.schema import TrainConfig
from vitkit.errors import ConfigError
from vitkit.models.vit import ViTConfig

ARCHITECTURE_FIELDS = ("patch_size", "hidden_size", "depth", "num_heads", "mlp_dim")
FINETUNE_RESOLUTION = 384  # the paper fine-tunes at 384 px (rounded to a multiple of the patch size)
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
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
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
        try:
            return str(json.loads(text))
        except ValueError:
            pass
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
    for key, value in changes.items():
        if value is not None:
            _check(field_type(key), value, key)
    cfg = cfg.override(**changes)
    parsed = parse_sets(sets)
    model_fields = {k[len(MODEL_OVERRIDES) :]: v for k, v in parsed.items() if k.startswith(MODEL_OVERRIDES)}
    parsed = {k: v for k, v in parsed.items() if not k.startswith(MODEL_OVERRIDES)}
    if model_fields:
        parsed["model.overrides"] = {**parsed.get("model.overrides", cfg.model.overrides), **model_fields}
    return cfg.override(**parsed)


def _check(tp: Any, value: Any, key: str) -> None:
    """A named option's value against the schema (the CLI's types already did this; the Python API may not)."""
    if isinstance(value, str) and tp is not str and typing.get_origin(tp) is not Literal:
        opt = typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)
        if not opt:
            raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def finetune_config(
    checkpoint: str, data: str, recipe: str = "paper-finetune", image_size: tuple[int, int] | None = None
) -> TrainConfig:
    """A fine-tuning recipe starting from ``checkpoint`` on ``data`` (``vitkit finetune``).

    Without an image size, the paper's 384 px rounded to a multiple of the checkpoint's patch size.
    """
    from vitkit.checkpoints import read_checkpoint

    cfg = get_recipe(recipe)
    if not cfg.model.init_from and cfg.model.name is not None:
        raise ConfigError(f"recipe {recipe!r} trains from scratch; use a fine-tuning recipe (paper-finetune, ...)")
    if image_size is None:
        patch = read_checkpoint(checkpoint).cfg.patch_size
        side = max(1, round(FINETUNE_RESOLUTION / patch)) * patch
        image_size = (side, side)
    return cfg.override(**{"model.init_from": checkpoint, "data.source": data, "data.image_size": image_size})
