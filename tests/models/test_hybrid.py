"""Hybrid ResNet + ViT (paper sec. 3.1): official parameter counts, an independent numpy reference of the
official stem semantics (vit_jax models_resnet.py / models_vit.py), npz round trips and compute accounting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from helpers import meta_model
from vitkit.checkpoints import official as off
from vitkit.models import VARIANTS, count_parameters, create_model
from vitkit.models.cost import cost_table
from vitkit.models.variants import HYBRIDS
from vitkit.models.vit import VisionTransformer


def official_hybrid_params(name: str, image: int = 224, classes: int = 1000) -> int:
    """Parameters of the official Flax hybrid, summed module by module from its definition."""
    size, layers, patch = HYBRIDS[name]
    v = VARIANTS[size]
    D, L, M = v["hidden_size"], v["depth"], v["mlp_dim"]
    total = 7 * 7 * 3 * 64 + 2 * 64  # conv_root (no bias) + gn_root
    cin = 64
    for n, depth in enumerate(layers):
        w = 64 * 2**n
        for m in range(depth):
            total += cin * w + 9 * w * w + w * 4 * w + 2 * (w + w + 4 * w)  # conv1-3 and gn1-3
            if m == 0:
                total += cin * 4 * w + 2 * 4 * w  # conv_proj + gn_proj
            cin = 4 * w
    stride = 2 ** (2 + max(len(layers) - 1, 0)) * patch
    n_tok = (image // stride) ** 2
    total += patch * patch * cin * D + D  # embedding conv on the ResNet map
    total += D + (n_tok + 1) * D  # cls + pos
    total += L * (4 * (D * D + D) + D * M + M + M * D + D + 4 * D) + 2 * D  # blocks + encoder_norm
    return total + D * classes + classes


def test_r50_b16_has_the_official_parameter_count() -> None:
    assert count_parameters(meta_model("R50+B/16")) == 98_659_112
    assert official_hybrid_params("R50+B/16") == 98_659_112


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_every_official_hybrid(name: str) -> None:
    model = meta_model(name)
    assert count_parameters(model) == official_hybrid_params(name)
    assert model.cfg.stride == (16 if name == "R50+B/16" else 32)  # R+Ti/16: root (4x) with 8x8 patches
    assert model.cfg.grid_size == (224 // model.cfg.stride,) * 2


@pytest.mark.parametrize(("name", "size"), [("R50+B/16", 224), ("R26+S/32", 384), ("R+Ti/16", (224, 320))])
def test_hybrid_macs_equal_torch_flop_counter(name: str, size: int | tuple[int, int]) -> None:
    model = meta_model(name, image_size=size)
    macs = sum(r.macs for r in cost_table(model))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, *model.cfg.image_size, device="meta"))
    assert macs == counter.get_total_flops() // 2
    assert sum(r.params for r in cost_table(model)) == count_parameters(model)


# ---- an independent numpy reference of the official stem (NHWC, float64) ------------------------------


def pad_same_np(x: np.ndarray, k: int, s: int, value: float = 0.0) -> np.ndarray:
    pads = [(0, 0)]
    for n in x.shape[1:3]:
        out = -(-n // s)
        total = max((out - 1) * s + k - n, 0)
        pads.append((total // 2, total - total // 2))
    return np.pad(x, [*pads, (0, 0)], constant_values=value)


def conv_np(x: np.ndarray, w: np.ndarray, s: int, same: bool = True) -> np.ndarray:
    """x (B, H, W, C), w (kh, kw, C, O) -> (B, H', W', O)."""
    k = w.shape[0]
    if same:
        x = pad_same_np(x, k, s)
    H = (x.shape[1] - k) // s + 1
    W = (x.shape[2] - k) // s + 1
    out = np.zeros((x.shape[0], H, W, w.shape[3]))
    for i in range(k):
        for j in range(k):
            out += x[:, i : i + s * H : s, j : j + s * W : s, :] @ w[i, j]
    return out


def std_conv_np(x: np.ndarray, w: np.ndarray, s: int = 1) -> np.ndarray:
    w = w - w.mean(axis=(0, 1, 2))
    w = w / (w.std(axis=(0, 1, 2)) + 1e-5)
    return conv_np(x, w, s)


def gn_np(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, groups: int = 32, eps: float = 1e-6) -> np.ndarray:
    B, H, W, C = x.shape
    g = x.reshape(B, H, W, groups, C // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = ((g - mean) ** 2).mean(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(B, H, W, C) * scale.reshape(-1) + bias.reshape(-1)


def max_pool_np(x: np.ndarray) -> np.ndarray:
    x = pad_same_np(x, 3, 2, value=-np.inf)
    H, W = (x.shape[1] - 3) // 2 + 1, (x.shape[2] - 3) // 2 + 1
    return np.max([x[:, i : i + 2 * H : 2, j : j + 2 * W : 2] for i in range(3) for j in range(3)], axis=0)


def unit_np(x: np.ndarray, a: dict[str, np.ndarray], p: str, stride: int) -> np.ndarray:
    relu = lambda t: np.maximum(t, 0)  # noqa: E731
    residual = x
    if f"{p}/conv_proj/kernel" in a:
        residual = gn_np(
            std_conv_np(x, a[f"{p}/conv_proj/kernel"], stride), a[f"{p}/gn_proj/scale"], a[f"{p}/gn_proj/bias"]
        )
    y = relu(gn_np(std_conv_np(x, a[f"{p}/conv1/kernel"]), a[f"{p}/gn1/scale"], a[f"{p}/gn1/bias"]))
    y = relu(gn_np(std_conv_np(y, a[f"{p}/conv2/kernel"], stride), a[f"{p}/gn2/scale"], a[f"{p}/gn2/bias"]))
    y = gn_np(std_conv_np(y, a[f"{p}/conv3/kernel"]), a[f"{p}/gn3/scale"], a[f"{p}/gn3/bias"])
    return relu(residual + y)


def stem_tokens_np(a: dict[str, np.ndarray], x: np.ndarray, layers: tuple[int, ...], patch: int) -> np.ndarray:
    """Official models_vit.py up to the token sequence: root, stages, embedding conv, flatten."""
    a = {k: v.astype(np.float64) for k, v in a.items()}
    y = np.maximum(gn_np(std_conv_np(x, a["conv_root/kernel"], 2), a["gn_root/scale"], a["gn_root/bias"]), 0)
    y = max_pool_np(y)
    for n, depth in enumerate(layers, 1):
        for m in range(1, depth + 1):
            y = unit_np(y, a, f"block{n}/unit{m}", 2 if (n > 1 and m == 1) else 1)
    y = conv_np(y, a["embedding/kernel"], patch, same=False) + a["embedding/bias"]
    return y.reshape(y.shape[0], -1, y.shape[-1])  # (B, N, D)


def random_hybrid(layers: tuple[int, ...], patch: int = 1, image: int = 64) -> VisionTransformer:
    model = vitkit.create_model(
        "R50+B/16", resnet_layers=layers, patch_size=patch, image_size=image, hidden_size=48, depth=1,
        num_heads=3, mlp_dim=96, num_classes=5, gelu="tanh",
    )  # fmt: skip
    with torch.no_grad():
        for m in model.modules():
            for name, p in m.named_parameters(recurse=False):
                p.normal_(0.0, 0.05)
                if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and name == "weight":
                    p.add_(1.0)
    return model.eval()


@pytest.mark.parametrize(("layers", "patch", "image"), [((1, 2), 1, 64), ((), 2, 48), ((2,), 1, 36)])
def test_stem_matches_numpy_reference_of_official_semantics(
    tmp_path: Path, layers: tuple[int, ...], patch: int, image: int
) -> None:
    """Stem output (tokens before the position embedding) vs the numpy reference on the exported arrays."""
    model = random_hybrid(layers, patch, image)
    path = off.write(model.state_dict(), model.cfg, tmp_path / "h.npz")
    arrays = dict(np.load(path))
    x = torch.randn(2, 3, image, image)
    ref = stem_tokens_np(arrays, x.permute(0, 2, 3, 1).double().numpy(), layers, patch)
    with torch.no_grad():
        ours = model.patch_embed(x).double().numpy()
    assert ours.shape == ref.shape
    err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert err < 1e-5, err


def test_hybrid_npz_round_trip_and_4d_group_norm_scales(tmp_path: Path) -> None:
    model = random_hybrid((1, 2))
    path = off.write(model.state_dict(), model.cfg, tmp_path / "h.npz")
    loaded = vitkit.load_pretrained(path)
    assert loaded.cfg.resnet_layers == (1, 2) and loaded.cfg.image_size == (64, 64)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    again = off.write(loaded.state_dict(), loaded.cfg, tmp_path / "again.npz")
    a, b = np.load(path), np.load(again)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # older checkpoints store GroupNorm parameters as (1, 1, 1, C)
    arrays = {k: (v.reshape(1, 1, 1, -1) if "/gn" in k else v) for k, v in a.items()}
    np.savez(tmp_path / "gn4d.npz", **arrays)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load_pretrained(tmp_path / "gn4d.npz")(x), model(x), rtol=0, atol=0)
    arrays["gn_root/scale"] = np.ones((2, 64), np.float32)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(vitkit.errors.CheckpointError, match=r"gn_root\.weight"):
        vitkit.load_pretrained(tmp_path / "bad.npz")


def test_hybrid_resolution_change_and_config_round_trip(tmp_path: Path) -> None:
    model = random_hybrid((1, 2))
    vitkit.save_pretrained(model, tmp_path / "m")
    loaded = vitkit.load_pretrained(tmp_path / "m", image_size=96)
    assert loaded.cfg.resnet_layers == (1, 2) and loaded.cfg.grid_size == (12, 12)
    with pytest.raises(vitkit.errors.ConfigError, match="hybrid stride"):
        create_model("R50+B/16", image_size=200)


@pytest.mark.parametrize(("factor", "root"), [(0.5, 32), (1.5, 96), (2, 128)])
def test_root_width_is_int_64_times_any_factor(tmp_path: Path, factor: float, root: int) -> None:
    """vit_jax's root takes ``width = int(64 * width_factor)`` channels for any factor (stages 2^n times that);
    a checkpoint with a 32-channel root reads back as factor 0.5, the same function."""
    model = vitkit.create_model(
        "R50+B/16", resnet_layers=(1, 1), resnet_width=factor, patch_size=1, image_size=32, hidden_size=48,
        depth=1, num_heads=3, mlp_dim=96, num_classes=5, gelu="tanh",
    )  # fmt: skip
    assert model.patch_embed.resnet.conv_root.out_channels == root
    assert model.patch_embed.resnet.stages.block2.unit1.conv1.out_channels == 2 * root
    path = off.write(model.state_dict(), model.cfg, tmp_path / "h.npz")
    assert np.load(path)["conv_root/kernel"].shape == (7, 7, 3, root)
    loaded = vitkit.load_pretrained(path)
    assert loaded.cfg.resnet_width == factor
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("factor", [0.25, 0.75, 0])
def test_root_width_the_official_group_norm_cannot_split_is_refused(factor: float) -> None:
    with pytest.raises(vitkit.errors.ConfigError, match="GroupNorm"):
        create_model("R50+B/16", resnet_width=factor)
