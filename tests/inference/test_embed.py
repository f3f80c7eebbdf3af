"""``vitkit embed``: vectors equal to the model's own features (pre-logits, pooled, intermediate blocks, on the
reference and the fast path), every format read back by its own library (pyarrow, numpy, safetensors), fp16 and
L2 normalisation, resume after SIGKILL equal to an uninterrupted run, and the Python API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import SRC, randomize_, run_cli
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset
from vitkit.inference.embed import EmbedOptions, embedding_vectors
from vitkit.inference.engine import InferenceEngine
from vitkit.models import create_model
from vitkit.outputs.array_reader import read_embeddings

CLASSES = ["cat", "dog", "ship"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=3, num_heads=2,
                                    mlp_dim=32, num_classes=3, representation_size=24))  # fmt: skip
    root = tmp_path_factory.mktemp("ckpt")
    return vitkit.save_pretrained(model.eval(), root / "m", preprocess=Preprocess(image_size=16), class_names=CLASSES)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder: 3 classes x 5 PNGs."""
    root = tmp_path_factory.mktemp("imgs")
    for c, name in enumerate(CLASSES):
        for i in range(5):
            rng = np.random.default_rng(10 * c + i)
            (root / name).mkdir(exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def direct(ckpt: Path, root: Path, what: str = "pre-logits", layer: int | None = None) -> tuple[np.ndarray, list]:
    """The model's own vectors of the folder's images, one forward per batch of 4 (as the jobs below), and
    the labels."""
    loaded = vitkit.load_checkpoint(ckpt)
    ds = open_dataset(str(root), "train")
    m = loaded.model
    out, labels = [], []
    for s in range(0, len(ds), 4):
        items = [ds[i] for i in range(s, min(s + 4, len(ds)))]
        x = torch.stack([loaded.meta.preprocess.to_tensor(img) for img, _ in items])
        labels += [lab for _, lab in items]
        with torch.no_grad():
            if what == "pre-logits":
                out.append(m.forward_head(m.forward_features(x), pre_logits=True))
                continue
            if layer is None:
                tokens = m.forward_features(x)
            else:
                tokens = m.forward_intermediates(x, attention=False).hidden_states[layer]
            out.append({"cls": tokens[:, 0], "gap": tokens[:, 1:].mean(1), "tokens": tokens}[what])
    return torch.cat(out).numpy(), labels


def read_back(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    """An output read by its format's own library: (vectors, ids, labels)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(path)
        shape = json.loads(t.schema.metadata[b"vitkit.shape"])
        vec = np.array(t.column("embedding").to_pylist(), dtype=np.float32).reshape(len(t), *shape)
        return vec, t.column("id").to_pylist(), t.column("label").to_pylist()
    if path.suffix == ".npy":
        side = json.loads(path.with_name(path.stem + ".ids.json").read_text())
        return np.load(path), side["ids"], side["labels"]
    from safetensors import safe_open
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        ids = json.loads(f.metadata()["vitkit.ids"])
    return tensors["embeddings"], ids, tensors["labels"].tolist()


@pytest.mark.parametrize("suffix", [".parquet", ".npy", ".safetensors"])
def test_each_format_holds_the_models_own_features_with_ids_and_labels(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, folder: Path, suffix: str
) -> None:
    out = tmp_path / f"feats{suffix}"
    code, _, err = run_cli(capsys, "embed", str(ckpt), "--data", str(folder), "--split", "train", "--out", str(out),
                           "--precision", "fp32", "--batch-size", "4", "--workers", "0")  # fmt: skip
    assert code == 0, err
    assert "wrote 15 embeddings" in err and not out.with_name(out.name + ".parts").exists()
    vec, ids, labels = read_back(out)
    want, want_labels = direct(ckpt, folder)
    assert vec.shape == (15, 24) and vec.dtype == np.float32  # the representation layer's width
    np.testing.assert_array_equal(vec, want)  # the reference path: the model's own forward, bit for bit
    assert labels == want_labels
    assert ids == [str(folder / CLASSES[i // 5] / f"{i % 5}.png") for i in range(15)]
    mine = read_embeddings(out)
    np.testing.assert_array_equal(mine.vectors, want)
    assert mine.ids == ids and mine.labels.tolist() == labels and mine.index.tolist() == list(range(15))


@pytest.mark.parametrize(
    ("pool", "layer"), [("cls", None), ("gap", None), ("tokens", None), ("cls", 2), ("tokens", -1), ("gap", 1)]
)
def test_pools_and_layers_equal_the_models_intermediates(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, folder: Path, pool: str, layer: int | None
) -> None:
    out = tmp_path / "f.npy"
    extra = [] if layer is None else ["--layer", str(layer)]
    code, _, err = run_cli(capsys, "embed", str(ckpt), "--data", str(folder), "--split", "train", "--out", str(out),
                           "--precision", "fp32", "--batch-size", "4", "--workers", "0", "--pool", pool,
                           *extra)  # fmt: skip
    assert code == 0, err
    depth = None if layer is None else (layer if layer > 0 else 3 + 1 + layer)
    want, _ = direct(ckpt, folder, pool, depth)
    got = np.load(out)
    assert got.shape == want.shape == ((15, 5, 32) if pool == "tokens" else (15, 32))
    np.testing.assert_array_equal(got, want)


def test_cls_and_mean_patch_concatenated(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path,
                                         folder: Path) -> None:  # fmt: skip
    """``--pool cls+gap`` (DINOv2's linear-probe features): the class token, then the mean of the patch tokens."""
    out = tmp_path / "f.npy"
    code, _, err = run_cli(capsys, "embed", str(ckpt), "--data", str(folder), "--split", "train", "--out", str(out),
                           "--precision", "fp32", "--workers", "0", "--pool", "cls+gap")  # fmt: skip
    assert code == 0, err
    (cls, _), (gap, _) = direct(ckpt, folder, "cls", None), direct(ckpt, folder, "gap", None)
    np.testing.assert_array_equal(np.load(out), np.concatenate([cls, gap], axis=1))
    loaded = vitkit.load_checkpoint(ckpt)
    x = torch.randn(3, 3, 16, 16)
    fast = InferenceEngine.from_loaded(loaded, precision="fp32", fp32_reference=False)
    ref = InferenceEngine.from_loaded(loaded, precision="fp32")
    opts = EmbedOptions(pool="cls+gap")
    np.testing.assert_allclose(embedding_vectors(fast, x, opts), embedding_vectors(ref, x, opts), atol=2e-5)


@pytest.mark.parametrize("layer", [None, 1, 3])
def test_the_fast_path_gives_the_same_vectors_within_rounding(ckpt: Path, layer: int | None) -> None:
    """The fp32 fast path (packed weights, only the first N blocks for --layer N) against the model itself."""
    loaded = vitkit.load_checkpoint(ckpt)
    x = torch.randn(6, 3, 16, 16)
    ref = InferenceEngine.from_loaded(loaded, precision="fp32")
    fast = InferenceEngine.from_loaded(loaded, precision="fp32", fp32_reference=False)
    assert fast.plan.path == "fast" and ref.plan.path != "fast"
    for pool in (None, "gap", "tokens") if layer is None else ("cls", "tokens"):
        opts = EmbedOptions(pool=pool, layer=layer)
        np.testing.assert_allclose(embedding_vectors(fast, x, opts), embedding_vectors(ref, x, opts), atol=2e-5)


def test_fp16_storage_and_l2_normalisation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, folder: Path
) -> None:
    out = tmp_path / "f.parquet"
    code, _, err = run_cli(capsys, "embed", str(ckpt), "--data", str(folder), "--split", "train", "--out", str(out),
                           "--precision", "fp32", "--batch-size", "4", "--workers", "0", "--dtype", "fp16",
                           "--l2")  # fmt: skip
    assert code == 0, err
    import pyarrow.parquet as pq

    assert str(pq.read_schema(out).field("embedding").type.value_type) == "halffloat"
    got = read_embeddings(out).vectors
    want, _ = direct(ckpt, folder)
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(got.astype(np.float32), axis=1), 1.0, atol=2e-3)


def test_resume_refuses_other_options_and_an_existing_output_without_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, folder: Path
) -> None:
    out = tmp_path / "f.safetensors"
    argv = ["embed", str(ckpt), "--data", str(folder), "--split", "train", "--out", str(out), "--workers", "0"]
    assert run_cli(capsys, *argv)[0] == 0
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "--resume" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, *argv, "--resume", "--l2")
    assert code == 2 and "other options" in err, err
    code, _, err = run_cli(capsys, *argv, "--resume")  # finished: nothing left to do
    assert code == 0 and "were there already" in err, err
    mine = tmp_path / "mine.npy"
    np.save(mine, np.zeros(3))  # a user's file (no vitkit ids file beside it): never overwritten
    code, _, err = run_cli(capsys, *argv[:-4], "--out", str(mine), "--overwrite", "--workers", "0")
    assert code == 2 and "not written by vitkit" in err, err
    np.testing.assert_array_equal(np.load(mine), np.zeros(3))


def _chunks(out: Path) -> int:
    parts = out.with_name(out.name + ".parts")
    return len(list(parts.glob("part-*.npz"))) if parts.is_dir() else 0


@pytest.mark.parametrize(
    "suffix",
    [".npy", pytest.param(".parquet", marks=pytest.mark.slow), pytest.param(".safetensors", marks=pytest.mark.slow)],
)  # ~10 s each, most of it a fresh interpreter importing torch
def test_resume_after_sigkill_equals_an_uninterrupted_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str
) -> None:
    """A real ``vitkit embed`` process killed with SIGKILL mid-run, then ``--resume``: the output equals an
    uninterrupted run's, nothing duplicated or lost."""
    model = randomize_(create_model("Ti/16", image_size=64, depth=4, num_classes=3))
    ckpt = vitkit.save_pretrained(model.eval(), tmp_path / "m", preprocess=Preprocess(image_size=64))
    n = 160
    for i in range(n):
        rng = np.random.default_rng(i)
        (tmp_path / "in").mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(tmp_path / "in" / f"{i:03d}.png")
    argv = ["embed", str(ckpt), str(tmp_path / "in"), "--batch-size", "2", "--workers", "1", "--precision", "fp32"]
    out = tmp_path / f"killed{suffix}"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "vitkit", *argv, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while _chunks(out) < 10 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()  # SIGKILL: no clean-up of any kind
    proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == -signal.SIGKILL, err
    cut = 2 * _chunks(out)
    assert 0 < cut < n and not out.exists(), err
    code, _, err = run_cli(capsys, *argv, "--out", str(out), "--resume")
    assert code == 0, err
    assert f"({cut} were there already)" in err or "were there already" in err
    whole = tmp_path / f"whole{suffix}"
    code, _, err2 = run_cli(capsys, *argv, "--out", str(whole))
    assert code == 0, err2
    got, want = read_back(out), read_back(whole)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] == [str(tmp_path / "in" / f"{i:03d}.png") for i in range(n)]


def test_python_api(ckpt: Path, folder: Path) -> None:
    """``vitkit.embed`` of files and of a dataset (labels kept): the model's own features, in input order."""
    want, labels = direct(ckpt, folder)
    ds = open_dataset(str(folder), "train")
    got = vitkit.embed(ckpt, ds, batch_size=4)
    np.testing.assert_array_equal(got.vectors, want)
    assert got.labels.tolist() == labels
    files = sorted(str(p) for p in folder.rglob("*.png"))
    by_file = vitkit.embed(ckpt, files, batch_size=4, l2=True)
    assert by_file.ids == files
    np.testing.assert_allclose(by_file.vectors, want / np.linalg.norm(want, axis=1, keepdims=True), rtol=1e-5)


def test_parquet_without_pyarrow_is_refused_before_any_work(monkeypatch, tmp_path):
    """Without the optional pyarrow, a .parquet output is one line before an image is read (it once failed only
    when assembling, after every embedding was computed, leaving the parts folder behind)."""
    from vitkit.errors import ConfigError
    from vitkit.outputs.array_reader import embeddings_format

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(ConfigError, match=r"needs pyarrow"):
        embeddings_format(tmp_path / "feats.parquet")
    assert embeddings_format(tmp_path / "feats.npy") == ".npy"


@pytest.mark.parametrize("pool", ["cls", "cls+gap"])
def test_class_token_pools_are_refused_without_a_class_token(pool: str) -> None:
    """A MAP model with registers has prefix tokens but no class token: its first token is a register."""
    model = create_model("Ti/16", image_size=16, patch_size=8, hidden_size=16, depth=1, num_heads=2, mlp_dim=32,
                         classifier="map", num_registers=2)  # fmt: skip
    assert model.cfg.num_prefix_tokens == 2 and not model.cfg.class_token
    with pytest.raises(vitkit.errors.ConfigError, match=re.escape(f"--pool {pool}: the model has no class token")):
        EmbedOptions(pool=pool).check(model.cfg.depth, bool(model.cfg.class_token))
