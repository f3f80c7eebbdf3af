"""Untrusted sizes: configs are validated (types, ranges, finite values) and checked against the tensors in the
file before anything is allocated; brace patterns are counted before they are expanded."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from helpers import FIXTURES
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.checkpoints.loaded import model_numel
from vitkit.data.datasets import open_dataset
from vitkit.data.wds import iter_braces
from vitkit.errors import CheckpointError, DataError
from vitkit.models.vit import ViTConfig


def tiny() -> vitkit.VisionTransformer:
    return vitkit.create_model(
        "Ti/16", image_size=8, patch_size=4, hidden_size=8, depth=2, num_heads=2, mlp_dim=16, num_classes=3
    )


def edited_vitkit(tmp_path: Path, **model: Any) -> Path:
    out = vitkit.save_pretrained(tiny(), tmp_path / "v")
    doc = json.loads((out / "config.json").read_text())
    doc["model"].update(model)
    (out / "config.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"depth": 10_000_000}, "depth 10000000 is outside 1..1024"),
        ({"depth": 1000}, "describes a model of"),  # within the bounds, but not what the file holds
        ({"depth": 3}, r"weights do not match the config \(Missing key"),
        ({"hidden_size": 40000, "num_heads": 2}, "describes a model of"),  # would be 25.6 GB
        ({"mlp_dim": 200_000}, "describes a model of"),
        ({"image_size": [65536, 65536], "patch_size": 4}, "tokens; at most"),
        ({"layer_norm_eps": math.nan}, "layer_norm_eps must be a finite number"),
        ({"layer_norm_eps": -1.0}, r"layer_norm_eps must be in \(0, 1\]"),
        ({"dropout": math.inf}, "dropout must be a finite number"),
        ({"depth": "12"}, "depth must be an integer"),
        ({"depth": True}, "depth must be an integer"),
        ({"hidden_size": 8.0}, "hidden_size must be an integer"),
        ({"image_size": "big"}, "image_size must be an integer or two"),
        ({"resnet_layers": [3, 4, "x"]}, "resnet_layers must be a list of integers"),
        ({"qkv_bias": "yes"}, "qkv_bias must be true or false"),
        ({"patch_size": -4}, "patch_size -4 is outside"),
    ],
)
def test_vitkit_config_is_checked_before_allocation(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = edited_vitkit(tmp_path, **change)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)
    assert time.perf_counter() - t0 < 10  # refused up front, not after building a huge model


def test_model_numel_is_the_state_dict_size() -> None:
    for cfg in (
        tiny().cfg,
        vitkit.create_model("B/16", num_classes=10).cfg,
        vitkit.create_model("R26+S/32").cfg,
    ):
        with torch.device("meta"):
            sd = vitkit.VisionTransformer(cfg).state_dict()
        assert model_numel(cfg) == sum(t.numel() for t in sd.values())
    huge = ViTConfig(hidden_size=40000, num_heads=8, mlp_dim=160000)  # computed on meta: no 25 GB
    assert model_numel(huge) > 6e9


def test_hf_config_sizes_are_checked(tmp_path: Path) -> None:
    model = vitkit.create_model("Ti/16", image_size=8, patch_size=4, hidden_size=8, depth=2, num_heads=2,
                                mlp_dim=16, num_classes=3)  # fmt: skip
    out = save_checkpoint(model, tmp_path / "hf", "hf")
    doc = json.loads((out / "config.json").read_text())
    for change, message in (
        ({"num_hidden_layers": 10_000_000}, "outside 1..1024"),
        ({"hidden_size": 40000, "num_attention_heads": 2}, "describes a model of"),
        ({"layer_norm_eps": "NaN"}, "layer_norm_eps"),
    ):
        (out / "config.json").write_text(json.dumps({**doc, **change}))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(out)


def test_layer_counts_read_from_key_names_are_checked(tmp_path: Path) -> None:
    """Formats without a config read the depth off key names: one tiny tensor named block 999 must not
    make a 1000-layer model."""
    arrays = dict(np.load(FIXTURES / "official_vit_tiny.npz"))
    arrays["Transformer/encoderblock_999/LayerNorm_0/scale"] = np.ones(1, np.float32)
    np.savez(tmp_path / "o.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="describes a model of"):
        load_checkpoint(tmp_path / "o.npz")
    save_checkpoint(tiny(), tmp_path / "t.safetensors", "timm")
    sd = load_file(tmp_path / "t.safetensors")
    sd["blocks.999.norm1.weight"] = torch.ones(1)
    save_file(sd, tmp_path / "t2.safetensors")
    with pytest.raises(CheckpointError, match="describes a model of"):
        load_checkpoint(tmp_path / "t2.safetensors")


def test_brace_patterns_are_counted_before_expanding(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"x-\{0\.\.99999999\}\.tar: names more than 1,000,000 shards"):
        list(iter_braces("x-{0..99999999}.tar"))
    with pytest.raises(DataError, match="names more than"):
        open_dataset(str(tmp_path / "x-{0..9999}-{0..9999}.tar"))
    with pytest.raises(DataError, match="invalid range"):
        list(iter_braces("x-{9..1}.tar"))
    assert time.perf_counter() - t0 < 5
    (tmp_path / "x-000.tar").write_bytes(b"")
    with pytest.raises(DataError, match=r"x-001\.tar: no such shard"):  # stops at the first missing shard
        open_dataset(str(tmp_path / "x-{000..999999}.tar"))
    assert list(iter_braces("a{1..2}-{8..10}.tar")) == [
        "a1-8.tar", "a1-9.tar", "a1-10.tar", "a2-8.tar", "a2-9.tar", "a2-10.tar"
    ]  # fmt: skip
