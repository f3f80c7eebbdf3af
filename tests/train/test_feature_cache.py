"""The feature cache: features computed by ``extract`` once, read back only when every part of the key and
every check of the file agree, recomputed (never trusted) otherwise, and resumable chunk by chunk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset
from vitkit.data.transforms import TrainTransform
from vitkit.errors import ConfigError
from vitkit.inference.features import ExtractOptions, extract
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer, ViTConfig
from vitkit.train import feature_cache as fc

PRE = Preprocess((8, 8), (0.5,) * 3, (0.5,) * 3, grayscale=True)


def tiny(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    return create_model(
        ViTConfig(), image_size=8, patch_size=4, in_channels=1, hidden_size=16, depth=1, num_heads=2, mlp_dim=32,
        num_classes=10, representation_size=12,
    ).eval()  # fmt: skip


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many examples went through ``extract`` (the cache's only way to compute)."""
    seen: list[int] = []

    def counting(*args: object, **kwargs: object) -> object:
        seen.append(len(kwargs["indices"]))  # type: ignore[arg-type]
        return extract(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fc, "extract", counting)
    monkeypatch.setattr(fc, "CHUNK", 100)
    return seen


def test_features_equal_extract_and_come_back_from_the_cache(tmp_path: Path, counted: list[int]) -> None:
    ds = open_dataset("digits", "test")  # 359 examples: 4 chunks of 100
    model = tiny()
    first = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    ref = extract(model, ds, PRE, logits=False, features=True, opts=ExtractOptions(progress=False))
    assert first.features.shape == (359, 12) and first.computed_chunks == 4 and sum(counted) == 359
    np.testing.assert_array_equal(first.features, ref.features)  # the pre-logits features, in dataset order
    np.testing.assert_array_equal(first.labels, ds.labels)
    counted.clear()
    again = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    assert counted == [] and again.cached_chunks == 4
    np.testing.assert_array_equal(again.features, first.features)
    doc = json.loads((again.folder / "key.json").read_text())
    assert doc["precision"] == "fp32" and doc["data"]["split"] == "test" and doc["preprocess"] == PRE.to_dict()


def test_every_part_of_the_key_separates_features(tmp_path: Path) -> None:
    ds = open_dataset("digits", "test")
    model = tiny()
    key = fc.feature_key(model, ds, PRE)
    other_head = tiny()
    with torch.no_grad():
        other_head.head.weight.normal_()
    assert fc.feature_key(other_head, ds, PRE) == key  # the head does not change pre-logits features
    with torch.no_grad():
        other_head.pre_logits[0].weight.add_(1e-3)
    variants = [
        fc.feature_key(other_head, ds, PRE),  # any weight before the head
        fc.feature_key(tiny(seed=1), ds, PRE),
        fc.feature_key(model, open_dataset("digits", "train"), PRE),
        fc.feature_key(model, ds, Preprocess((8, 8), (0.4,) * 3, (0.5,) * 3, grayscale=True)),
        fc.feature_key(model, ds, Preprocess((8, 8), (0.5,) * 3, (0.5,) * 3, grayscale=True, interpolation="bicubic")),
        fc.feature_key(model, ds, PRE, augment=_pass(1)),
        fc.feature_key(model, ds, PRE, augment=_pass(2)),
        fc.feature_key(model, ds, PRE, device="meta"),
        fc.feature_key(model, ds, PRE, precision="bf16"),
        fc.feature_key(model, ds, PRE, precision="int8"),
    ]
    digests = {fc.key_digest(k) for k in [key, *variants]}
    assert len(digests) == len(variants) + 1
    with pytest.raises(ConfigError, match="feature precision 'fp16'"):
        fc.feature_key(model, ds, PRE, precision="fp16")  # not a precision features are computed in


def _pass(epoch: int) -> fc.AugmentedPass:
    t = TrainTransform((8, 8), crop="pad", pad=1, flip=False, mean=(0.5,), std=(0.5,), grayscale=True)
    return fc.AugmentedPass(t, seed=0, epoch=epoch, identity={"crop": "pad", "pad": 1})


def test_a_changed_data_file_gets_new_features(tmp_path: Path) -> None:
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (30, 8, 8), dtype=np.uint8)
    np.savez(data, images=images, labels=np.arange(30) % 3)
    model = tiny()
    key = fc.feature_key(model, open_dataset(data, "train"), PRE)
    np.savez(data, images=255 - images, labels=np.arange(30) % 3)  # same labels, new pixels
    os.utime(data, ns=(1, 1))  # a different modification time even on a coarse clock
    assert fc.feature_key(model, open_dataset(data, "train"), PRE)["data"] != key["data"]


def test_augmented_passes_follow_the_training_draws(tmp_path: Path) -> None:
    ds = open_dataset("digits", "test")
    model = tiny()
    one = fc.cached_features(model, ds, PRE, root=tmp_path, augment=_pass(1), progress=False)
    two = fc.cached_features(model, ds, PRE, root=tmp_path, augment=_pass(2), progress=False)
    clean = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    assert len({one.folder, two.folder, clean.folder}) == 3
    assert not np.array_equal(one.features, two.features) and not np.array_equal(one.features, clean.features)
    again = fc.cached_features(model, ds, PRE, root=tmp_path, augment=_pass(1), progress=False)
    assert again.computed_chunks == 0  # all from the cache
    np.testing.assert_array_equal(again.features, one.features)


@pytest.mark.parametrize("damage", ["truncated", "shape", "nan", "labels", "extra", "not-safetensors"])
def test_a_damaged_chunk_is_recomputed_never_used(tmp_path: Path, counted: list[int], damage: str) -> None:
    ds = open_dataset("digits", "test")
    model = tiny()
    first = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    path = first.folder / "chunk-000001.safetensors"
    good = load_file(str(path))
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "not-safetensors":
        path.write_bytes(b"\x00" * 64)
    else:
        t = dict(good)
        if damage == "shape":
            t["features"] = t["features"][:, :-1].copy()
        elif damage == "nan":
            t["features"] = t["features"].copy()
            t["features"][3, 2] = np.nan
        elif damage == "labels":
            t["labels"] = (t["labels"] + 1) % 10
        else:
            t["more"] = np.zeros(3, dtype=np.float32)
        save_file(t, str(path))
    counted.clear()
    again = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    assert counted == [100] and again.computed_chunks == 1  # only the damaged chunk, computed again
    np.testing.assert_array_equal(again.features, first.features)
    np.testing.assert_array_equal(load_file(str(path))["features"], good["features"])  # and replaced


def test_a_folder_whose_key_file_differs_is_not_trusted(tmp_path: Path, counted: list[int]) -> None:
    ds = open_dataset("digits", "test")
    model = tiny()
    first = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    doc = json.loads((first.folder / "key.json").read_text())
    doc["precision"] = "bf16"
    (first.folder / "key.json").write_text(json.dumps(doc))
    counted.clear()
    again = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    assert sum(counted) == 359 and again.cached_chunks == 0
    np.testing.assert_array_equal(again.features, first.features)


def test_an_interrupted_pass_keeps_its_finished_chunks(tmp_path: Path, counted: list[int]) -> None:
    ds = open_dataset("digits", "test")
    model = tiny()

    class Stop(Exception):
        pass

    def stop_after_two(c: int) -> None:
        if c == 1:
            raise Stop

    with pytest.raises(Stop):
        fc.cached_features(model, ds, PRE, root=tmp_path, progress=False, on_chunk=stop_after_two)
    assert counted == [100, 100]
    counted.clear()
    rest = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    assert counted == [100, 59] and rest.cached_chunks == 2
    ref = extract(model, ds, PRE, logits=False, features=True, opts=ExtractOptions(progress=False))
    np.testing.assert_array_equal(rest.features, ref.features)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(("precision", "same_path", "to_fp32"), [("bf16", 0.01, 0.03), ("int8", 0.05, 0.1)])
def test_fast_path_features_under_their_own_key(
    tmp_path: Path, precision: str, same_path: float, to_fp32: float
) -> None:
    """``precision="bf16"`` / ``"int8"``: the features of ``optimize_for_inference``'s model (its pre-logits layer
    included), close to the fp32 model's (rounding; int8's activation scales are per batch), cached apart."""
    from vitkit.inference.fast import optimize_for_inference

    ds = open_dataset("digits", "test")
    model = tiny()
    fp32 = fc.cached_features(model, ds, PRE, root=tmp_path, progress=False)
    fast_feats = fc.cached_features(model, ds, PRE, root=tmp_path, precision=precision, progress=False)
    assert fast_feats.folder != fp32.folder and fast_feats.computed_chunks == 1
    assert json.loads((fast_feats.folder / "key.json").read_text())["precision"] == precision
    fast = optimize_for_inference(model, torch.bfloat16, int8=precision == "int8")
    x = torch.stack([PRE(ds[i][0]) for i in range(len(ds))])  # (N, 1, 8, 8)
    with torch.no_grad():
        want = fast.base.forward_head(fast.forward_features(x), pre_logits=True).float().numpy()  # type: ignore[operator]
    assert _rel(fast_feats.features, want) < same_path  # the same path (batching apart)
    assert 0 < _rel(fast_feats.features, fp32.features) < to_fp32  # rounded: near the fp32 features, not them
    again = fc.cached_features(model, ds, PRE, root=tmp_path, precision=precision, progress=False)
    assert again.cached_chunks == 1 and again.computed_chunks == 0
    np.testing.assert_array_equal(again.features, fast_feats.features)


def test_fast_features_are_the_engines_own(tmp_path: Path) -> None:
    """bf16 features are what the engine's bf16 eval computes (``vitkit eval --precision bf16``): its fast path,
    on JPEGs decoded at the reduced scale that path allows. The stand-in model that computed them before ran
    inside an fp32 "reference" engine, so its JPEGs were decoded at full scale: other pixels, other features."""
    from PIL import Image

    from vitkit.inference.engine import InferenceEngine

    for i in range(12):  # 128 x 96 JPEGs for an 8 x 8 input: the fast path decodes them at 1/4 scale
        folder = tmp_path / "data" / "train" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        small = np.random.default_rng(i).integers(0, 256, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(small).resize((128, 96), Image.Resampling.BILINEAR).save(folder / f"{i:02d}.jpg", quality=92)
    ds = open_dataset(tmp_path / "data", "train")
    torch.manual_seed(0)
    model = create_model(
        ViTConfig(), image_size=8, patch_size=4, hidden_size=16, depth=1, num_heads=2, mlp_dim=32, num_classes=2,
        representation_size=12,
    ).eval()  # fmt: skip
    pre = Preprocess((8, 8))
    got = fc.cached_features(model, ds, pre, root=tmp_path / "cache", precision="bf16", progress=False)
    engine = InferenceEngine(model, pre, precision="bf16", batch_size=64)
    assert not engine.plan.full_decode and engine.runner is not model
    want = extract(engine, ds, pre, logits=False, features=True, opts=ExtractOptions(progress=False))
    np.testing.assert_array_equal(got.features, want.features)
    full = engine.features(torch.stack([pre(ds[i][0]) for i in range(len(ds))])).numpy()  # fully decoded JPEGs
    assert not np.array_equal(got.features, full) and _rel(got.features, full) < 0.1
