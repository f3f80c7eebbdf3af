"""Training config values are finite, and positive where a run divides or steps by them (issue 47, item 10):
``--set epochs=nan``, ``epochs=inf``, ``optim.lr=nan``, ``optim.eps=nan``, ``log_every_steps=0`` and a
``data.workers`` past the machine's bound are one-line ConfigErrors, and a learning-rate sweep refuses a NaN
learning rate instead of naming its four runs ``lr-nan``."""

from __future__ import annotations

import dataclasses

import pytest

from vitkit.configs import TrainConfig, apply_overrides, get_recipe
from vitkit.errors import ConfigError
from vitkit.hardware import max_workers
from vitkit.train.sweep import check_sweep


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ("epochs=nan", "epochs"),
        ("epochs=inf", "epochs"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.eps=nan", "optim.eps"),
        ("optim.eps=-inf", "optim.eps"),
        ("optim.betas=[0.9, NaN]", "optim.betas"),
        ("log_every_steps=0", "log_every_steps"),
        ("eval_every_epochs=0", "eval_every_epochs"),
        ("optim.eps=0", "optim.eps"),
    ],
)
def test_a_non_finite_or_zero_value_is_one_line(item: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        apply_overrides(get_recipe("digits"), sets=[item]).validate()
    assert "\n" not in str(e.value)


def test_data_workers_are_bounded_by_the_machine() -> None:
    cfg = get_recipe("digits")
    apply_overrides(cfg, sets=[f"data.workers={max_workers()}"]).validate()
    with pytest.raises(ConfigError, match=r"data\.workers must be an integer in 0\.\."):
        apply_overrides(cfg, sets=["data.workers=100000"]).validate()


def test_a_sweep_refuses_a_nan_learning_rate() -> None:
    """Whatever way a NaN got into the config (not through --set, which refuses it), the sweep does not start."""
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, select=True))
    check_sweep(cfg)
    nan = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=float("nan")))
    with pytest.raises(ConfigError, match=r"optim\.lr nan"):
        check_sweep(nan)
