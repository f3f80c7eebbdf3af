"""Recipes changed from the command line: named options and ``--set KEY=VALUE``, typed by the schema."""

from __future__ import annotations

import re

import pytest

from vitkit.configs import apply_overrides, get_recipe
from vitkit.errors import ConfigError


def test_set_values_take_the_schema_types() -> None:
    cfg = apply_overrides(
        get_recipe("digits"),
        {},
        ["optim.lr=1e-3", "data.image_size=32", "aug.crop_scale=0.5,1", "ema_decay=null", "compile=true",
         "optim.name=sgd", "model.overrides.depth=2", "model.overrides.drop_path=0.1"],
    )  # fmt: skip
    assert cfg.optim.lr == 1e-3 and cfg.data.image_size == (32, 32) and cfg.aug.crop_scale == (0.5, 1.0)
    assert cfg.ema_decay is None and cfg.compile is True and cfg.optim.name == "sgd"
    assert cfg.model.overrides["depth"] == 2 and cfg.model.overrides["drop_path"] == 0.1
    assert cfg.model.overrides["hidden_size"] == 64  # the recipe's other model fields stay


def test_named_options_keep_their_rules() -> None:
    base = get_recipe("digits")
    cfg = apply_overrides(base, {"model.name": "S/16", "epochs": 3.0})
    assert cfg.model.name == "S/16" and cfg.model.overrides == {"classifier": "gap"}  # architecture replaced
    assert cfg.epochs == 3.0 and cfg.steps is None
    assert apply_overrides(base, {"epochs": 3.0, "steps": 7}).steps == 7  # steps win


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optim.lr=abc", "--set optim.lr=abc: expected a number"),
        ("model.overrides.depth=two", "--set model.overrides.depth=two: expected an integer"),
        ("optim.name=lion", "--set optim.name=lion: expected one of 'adamw', 'adam', 'sgd'"),
        ("compile=maybe", "--set compile=maybe: expected true or false"),
        ("optim.nope=1", "unknown config field 'optim.nope'"),
        ("model.overrides.nope=1", "unknown model field 'nope'"),
        ("lr", "--set expects KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        apply_overrides(get_recipe("digits"), {}, [item])


def test_the_python_api_checks_types_too() -> None:
    with pytest.raises(ConfigError, match=r"optim\.lr: expected a number"):
        get_recipe("digits").override(**{"optim.lr": "abc"})
    # text where the schema wants a list or an object was taken as it was, and failed later in the run
    with pytest.raises(ConfigError, match=r"^config\.data\.image_size: expected a list, got '224'"):
        get_recipe("digits").override(**{"data.image_size": "224"})
    with pytest.raises(ConfigError, match=r"^config\.model\.overrides: expected an object, got 'depth=2'"):
        get_recipe("digits").override(**{"model.overrides": "depth=2"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optim.lr": "abc"}, "optim.lr: expected a number, got 'abc'"),
        ({"epochs": "3"}, "epochs: expected a number, got '3'"),
        ({"data.image_size": "224"}, "data.image_size: expected a list, got '224'"),
        ({"model.overrides": "depth=2"}, "model.overrides: expected an object, got 'depth=2'"),
        ({"precision": "fp16"}, "precision: 'fp16' is not one of 'fp32', 'bf16', 'auto'"),
        ({"model.overrides.depth": "two"}, "model.overrides.depth: expected an integer, got 'two'"),
    ],
)
def test_named_options_are_checked_by_the_schema_naming_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        apply_overrides(get_recipe("digits"), changes)
    assert apply_overrides(get_recipe("digits"), {"epochs": 3}).epochs == 3.0  # an int where a float goes is one
