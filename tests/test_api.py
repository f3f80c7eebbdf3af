"""The top-level public API: every advertised name exists and the pieces fit together."""

from __future__ import annotations

import torch

import vitkit


def test_every_public_name_resolves() -> None:
    for name in vitkit.__all__:
        assert getattr(vitkit, name) is not None, name


def test_the_public_pieces_compose() -> None:
    test = vitkit.open_dataset("digits", "test")
    assert len(test) == 359
    cfg = vitkit.get_recipe("digits")
    assert isinstance(cfg, vitkit.TrainConfig) and cfg.data.source == "digits"
    model = vitkit.create_model("Ti/16", num_classes=10, image_size=32)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
