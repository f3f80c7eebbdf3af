"""Google's vit_jax .npz layout, proven against golden data from the official implementation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage
import torch

import vitkit
from helpers import FIXTURES, official_io, rel_err
from vitkit.checkpoints import detect_format, load_checkpoint
from vitkit.checkpoints import official as off
from vitkit.errors import CheckpointError

CKPT = FIXTURES / "official_vit_tiny.npz"


def test_config_inferred_from_shapes() -> None:
    cfg = vitkit.load_pretrained(CKPT).cfg
    ref = json.loads((FIXTURES / "official_vit_tiny.json").read_text())
    assert cfg.image_size == (ref["image_size"],) * 2
    assert cfg.patch_size == ref["patch_size"]
    assert (cfg.hidden_size, cfg.mlp_dim, cfg.num_heads, cfg.depth) == (48, 96, 3, 2)
    assert cfg.num_classes == ref["num_classes"] and cfg.classifier == "token"
    assert cfg.representation_size is None and cfg.gelu == "tanh" and cfg.layer_norm_eps == 1e-6


def test_reproduces_official_logits() -> None:
    x, ref = official_io()
    assert detect_format(CKPT) == "official"
    model = vitkit.load_pretrained(CKPT)
    with torch.no_grad():
        err = rel_err(model(x).numpy(), ref)
    assert err < 1e-5, err


def test_exact_gelu_is_measurably_different() -> None:
    """The tanh GELU matters: with PyTorch's erf GELU the error is ~2e-4, well outside tolerance."""
    x, ref = official_io()
    model = vitkit.load_pretrained(CKPT)
    for blk in model.blocks:
        blk.mlp.gelu = "exact"
    with torch.no_grad():
        err = rel_err(model(x).numpy(), ref)
    assert 2e-5 < err < 2e-3


def test_fused_and_explicit_attention_agree_on_official_weights() -> None:
    x, ref = official_io()
    model = vitkit.load_pretrained(CKPT)
    with torch.no_grad():
        assert rel_err(model.forward_intermediates(x).logits.numpy(), ref) < 1e-5


def test_export_round_trip_is_bit_exact(tmp_path: Path) -> None:
    model = vitkit.load_pretrained(CKPT)
    out = off.write(model.state_dict(), model.cfg, tmp_path / "again.npz")
    a, b = np.load(CKPT), np.load(out)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _write(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    np.savez(path, **arrays)
    return path


def test_missing_key_is_named(tmp_path: Path) -> None:
    arrays = dict(np.load(CKPT))
    del arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_0/bias"]
    with pytest.raises(CheckpointError, match=r"missing keys: .*encoderblock_1/MlpBlock_3/Dense_0/bias"):
        vitkit.load_pretrained(_write(tmp_path / "m.npz", arrays))


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    arrays = dict(np.load(CKPT))
    arrays["Transformer/encoderblock_0/LayerNorm_2/scale"] = np.ones(47, np.float32)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.norm2\.weight: expected \(48,\), got \(47,\)"):
        vitkit.load_pretrained(_write(tmp_path / "m.npz", arrays))


def test_unexpected_key_is_named(tmp_path: Path) -> None:
    arrays = dict(np.load(CKPT))
    arrays["Transformer/encoderblock_0/extra/kernel"] = np.ones(3, np.float32)
    with pytest.raises(CheckpointError, match=r"unexpected keys: Transformer/encoderblock_0/extra/kernel"):
        vitkit.load_pretrained(_write(tmp_path / "m.npz", arrays))


def test_unreadable_and_unknown_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=r"bad\.npz"):
        vitkit.load_pretrained(bad, format="official")
    with pytest.raises(CheckpointError, match="not a checkpoint in any known format"):
        vitkit.load_pretrained(FIXTURES / "official_vit_tiny.io.npz")
    with pytest.raises(CheckpointError, match="no such file"):
        vitkit.load_pretrained(tmp_path / "absent.npz")


def test_resolution_change_reproduces_official_interpolate_posembed() -> None:
    model = vitkit.load_pretrained(CKPT, image_size=56)  # 4x4 grid -> 7x7
    pe = np.load(CKPT)["Transformer/posembed_input/pos_embedding"]
    grid = pe[0, 1:].reshape(4, 4, -1)
    ref = np.concatenate([pe[:, :1], scipy.ndimage.zoom(grid, (7 / 4, 7 / 4, 1), order=1).reshape(1, 49, -1)], 1)
    assert model.pos_embed is not None
    np.testing.assert_allclose(model.pos_embed.detach().numpy(), ref, rtol=1e-6, atol=1e-7)
    loaded = load_checkpoint(CKPT, image_size=56)
    assert loaded.meta.preprocess.image_size == (56, 56)
    assert model(torch.randn(1, 3, 56, 56)).shape == (1, 5)


def test_new_head_for_fine_tuning() -> None:
    model = vitkit.load_pretrained(CKPT, num_classes=11)
    assert model.cfg.num_classes == 11 and model.head.weight.abs().sum() == 0


def test_gap_and_pre_logits_layouts(tmp_path: Path) -> None:
    """A GAP model with a pre-logits layer survives export -> load with identical outputs."""
    model = vitkit.create_model(
        "Ti/16", image_size=32, num_classes=3, classifier="gap", representation_size=16, gelu="tanh"
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    path = off.write(model.state_dict(), model.cfg, tmp_path / "gap.npz")
    keys = set(np.load(path).files)
    assert "cls" not in keys and "pre_logits/kernel" in keys
    loaded = vitkit.load_pretrained(path)
    assert loaded.cfg.classifier == "gap" and loaded.cfg.representation_size == 16
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model.eval()(x))
