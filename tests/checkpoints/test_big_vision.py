"""big_vision .npz: proven against the official implementation's golden logits (the fixture re-laid out the
way big_vision's own fix_old_checkpoints reads it), plus exact round trips in every sub-layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from helpers import FIXTURES, official_io, randomize_, rel_err
from vitkit.checkpoints import big_vision as bv
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

CKPT = FIXTURES / "official_vit_tiny.npz"
RENAMES = [("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0"), ("MlpBlock_3", "MlpBlock_0")]


def as_big_vision(old_posemb: bool = False, scan: bool = False) -> dict[str, np.ndarray]:
    """The golden official checkpoint in big_vision's layout: Linen names, params/ prefix, and (unless
    ``old_posemb``) the class slot of the position embedding summed into ``cls``, as big_vision does."""
    out: dict[str, np.ndarray] = {}
    for k, v in np.load(CKPT).items():
        for a, b in RENAMES:
            k = k.replace(a, b)
        k = k.replace("/LayerNorm_2/", "/LayerNorm_1/")
        out[k] = v
    if not old_posemb:
        pe = out.pop("Transformer/posembed_input/pos_embedding")
        out["cls"] = out["cls"] + pe[:, :1]
        out["pos_embedding"] = pe[:, 1:]
    if scan:
        out = bv.stack_scan(out, 2)
    return {f"params/{k}": v for k, v in out.items()}


@pytest.mark.parametrize(("old_posemb", "scan"), [(False, False), (True, False), (False, True)])
def test_reproduces_official_logits(tmp_path: Path, old_posemb: bool, scan: bool) -> None:
    np.savez(tmp_path / "bv.npz", **as_big_vision(old_posemb, scan))  # type: ignore[arg-type]
    assert detect_format(tmp_path / "bv.npz") == "big_vision"
    loaded = load_checkpoint(tmp_path / "bv.npz")
    assert loaded.meta.provenance["scan"] == scan and loaded.model.cfg.gelu == "tanh"
    x, ref = official_io()
    with torch.no_grad():
        err = rel_err(loaded.model(x).numpy(), ref)
    assert err < 1e-5, err


@pytest.mark.parametrize("scan", [False, True])
def test_export_round_trip_is_bit_exact(tmp_path: Path, scan: bool) -> None:
    model = randomize_(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=3, num_classes=4, gelu="tanh"))
    assert model.pos_embed is not None and model.pos_embed[0, 0].abs().sum() > 0  # a nonzero class slot
    path = bv.write(model.eval(), tmp_path / "m.npz", scan=scan)
    keys = set(np.load(path).files)
    assert "params/pos_embedding" in keys and np.load(path)["params/pos_embedding"].shape == (1, 16, 192)
    block_key = "params/Transformer/encoderblock/LayerNorm_0/scale"
    assert (block_key in keys) == scan
    if scan:
        assert np.load(path)[block_key].shape == (3, 192)
    loaded = vitkit.load_pretrained(path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_gap_sincos_and_pre_logits(tmp_path: Path) -> None:
    model = randomize_(
        vitkit.create_model(
            "Ti/16",
            image_size=32,
            patch_size=8,
            depth=1,
            num_classes=3,
            classifier="gap",
            pos_embed="sincos2d",
            representation_size=16,
            gelu="tanh",
        )
    ).eval()
    path = save_checkpoint(model, tmp_path / "g.npz", "big_vision")
    keys = set(np.load(path).files)
    assert "params/cls" not in keys and "params/pos_embedding" not in keys and "params/pre_logits/kernel" in keys
    loaded = load_checkpoint(path, image_size=32)  # sin-cos stores no grid: the caller says the size
    assert loaded.model.cfg.pos_embed == "sincos2d" and loaded.model.cfg.classifier == "gap"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), model(x), rtol=0, atol=0)


def test_refusals(tmp_path: Path) -> None:
    arrays = as_big_vision()
    np.savez(tmp_path / "map.npz", **arrays, **{"params/MAPHead_0/probe": np.zeros((1, 1, 48), np.float32)})
    with pytest.raises(CheckpointError, match="pool_type='map'"):  # this reader's refusal; detection picks siglip
        vitkit.load_pretrained(tmp_path / "map.npz", format="big_vision")
    with pytest.raises(CheckpointError, match="cls: a class token beside a MAP head"):
        vitkit.load_pretrained(tmp_path / "map.npz")
    partial = dict(arrays)
    del partial["params/Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel"]
    np.savez(tmp_path / "partial.npz", **partial)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"missing keys: Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel"):
        vitkit.load_pretrained(tmp_path / "partial.npz")
    hybrid = vitkit.create_model("R+Ti/16", image_size=64, depth=1, num_classes=2, gelu="tanh")
    with pytest.raises(CheckpointError, match="no hybrid"):
        save_checkpoint(hybrid, tmp_path / "h.npz", "big_vision")
    exact = vitkit.create_model("Ti/16", image_size=32, num_classes=2)  # exact GELU: not Google's function
    for fmt in ("big_vision", "official"):
        with pytest.raises(CheckpointError, match="tanh GELU"):
            save_checkpoint(exact, tmp_path / f"{fmt}.npz", fmt)
    assert not any(tmp_path.glob("*.npz.*"))


def test_layouts_are_never_confused(tmp_path: Path) -> None:
    np.savez(tmp_path / "bv.npz", **as_big_vision())  # type: ignore[arg-type]
    assert detect_format(CKPT) == "official"
    assert detect_format(tmp_path / "bv.npz") == "big_vision"
    with pytest.raises(CheckpointError, match="not a checkpoint in any known format"):
        detect_format(FIXTURES / "official_vit_tiny.io.npz")
    # forcing the wrong format is refused with what is missing, not a silent partial load
    with pytest.raises(CheckpointError, match="missing"):
        vitkit.load_pretrained(tmp_path / "bv.npz", format="official")
