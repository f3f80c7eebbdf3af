"""``predict`` and ``eval`` on a DeiT distilled model: its logits are the mean of the class and distillation heads
(``model(x)``) on every path, the engine's features-and-logits call included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import randomize_, run_cli
from vitkit import load_checkpoint
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.inference.engine import InferenceEngine

NAMES = ["c0", "c1", "c2", "c3", "c4"]


@pytest.fixture(scope="module")
def deit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A random distilled model (two different heads) saved with class names, and 12 images as PNG files."""
    root = tmp_path_factory.mktemp("deit")
    torch.manual_seed(0)
    model = vitkit.create_model("Ti/16", image_size=16, patch_size=8, hidden_size=32, depth=2, num_heads=2,
                                mlp_dim=64, num_classes=5, distilled=True)  # fmt: skip
    randomize_(model, std=0.3)
    ckpt = vitkit.save_pretrained(model.eval(), root / "m", preprocess=Preprocess(image_size=16), class_names=NAMES)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(12):
        paths.append(root / f"img{i:02d}.png")
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(paths[-1])
    return ckpt, paths


def _inputs(ckpt: Path, paths: list[Path]) -> tuple[torch.nn.Module, torch.Tensor]:
    loaded = load_checkpoint(ckpt)
    x = torch.stack([loaded.meta.preprocess.to_tensor(Image.open(p)) for p in paths])
    return loaded.model.eval(), x


def test_predict_top1_is_the_argmax_of_both_heads_mean(
    capsys: pytest.CaptureFixture[str], deit: tuple[Path, list[Path]]
) -> None:
    ckpt, paths = deit
    model, x = _inputs(ckpt, paths)
    with torch.no_grad():
        want = model(x).argmax(-1).numpy()
        tokens = model.forward_features(x)
        cls_only = model.head(tokens[:, 0]).argmax(-1).numpy()
    assert (want != cls_only).any()  # the images tell the heads' mean from the class head alone
    code, out, err = run_cli(capsys, "predict", "-c", str(ckpt), *map(str, paths), "--json", "--precision", "fp32")
    assert code == 0, err
    rows = {json.loads(line)["image"]: json.loads(line) for line in out.splitlines()}
    got = [NAMES.index(rows[str(p)]["top"][0]["label"]) for p in paths]
    np.testing.assert_array_equal(got, want)


def test_engine_logits_with_features_are_the_heads_mean(deit: tuple[Path, list[Path]]) -> None:
    ckpt, paths = deit
    model, x = _inputs(ckpt, paths)
    engine = InferenceEngine(model, load_checkpoint(ckpt).meta.preprocess, precision="fp32", device="cpu")
    out = engine.forward(x, logits=True, features=True)
    with torch.no_grad():
        want = model(x)
        rep = model.forward_head(model.forward_features(x), pre_logits=True)
    assert out.logits is not None and out.features is not None
    torch.testing.assert_close(out.logits, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.features, rep, rtol=1e-6, atol=1e-6)


def test_eval_top1_is_that_of_both_heads_mean(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deit: tuple[Path, list[Path]]
) -> None:
    ckpt, paths = deit
    model, x = _inputs(ckpt, paths)
    with torch.no_grad():
        preds = model(x).argmax(-1).numpy()
    labels = np.arange(len(paths)) % len(NAMES)
    for p, y in zip(paths, labels, strict=True):  # a folder data set: one class folder per name
        folder = tmp_path / "data" / "val" / NAMES[y]
        folder.mkdir(parents=True, exist_ok=True)
        Image.open(p).save(folder / p.name)
    code, out, err = run_cli(
        capsys, "eval", str(ckpt), "--data", str(tmp_path / "data"), "--split", "val", "--out", str(tmp_path / "o"),
        "--json", "--precision", "fp32", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["top1"] == pytest.approx(float((preds == labels).mean()))
