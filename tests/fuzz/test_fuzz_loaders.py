"""Fuzzing every loader of untrusted files with Hypothesis: mutated checkpoints (vitkit folder, HF config,
Google .npz, timm safetensors / pickle), images, CIFAR pickles, .npz datasets, label files and tar shards.

The only allowed outcomes are a result or vitkit's own one-line error (``VitkitError``), within a time bound
(SIGALRM per example) and a memory bound (address-space limit while the test runs). The default suite runs a
fast, derandomised profile; ``-m slow`` runs many more examples.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import resource
import signal
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import vitkit  # noqa: E402
from helpers import FIXTURES  # noqa: E402
from vitkit.checkpoints import load_checkpoint, save_checkpoint  # noqa: E402
from vitkit.data.datasets import open_dataset  # noqa: E402
from vitkit.errors import VitkitError  # noqa: E402
from vitkit.evaluate.metrics import read_label_sets  # noqa: E402
from vitkit.images import load_image  # noqa: E402

SECONDS_PER_EXAMPLE = 20
EXTRA_ADDRESS_SPACE = 6 << 30  # bytes of virtual memory an example may add


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """A time limit per example and an address-space limit (so a runaway allocation fails, not the machine)."""

    def alarm(*_: Any) -> None:
        raise _Timeout(f"example ran over {SECONDS_PER_EXAMPLE} s")

    old_handler = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS_PER_EXAMPLE)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    limit = vm + EXTRA_ADDRESS_SPACE
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)


OUTCOMES: collections.Counter[str] = collections.Counter()  # reported with pytest -s


def allowed(fn: Callable[[], Any]) -> None:
    """Run ``fn``: a result or a one-line VitkitError pass; anything else fails the example."""
    with bounded():
        try:
            fn()
            OUTCOMES["result"] += 1
        except VitkitError as e:
            msg = str(e)
            assert msg and "\n" not in msg, f"not a one-line error: {msg!r}"
            OUTCOMES["VitkitError"] += 1


# ---- mutations ------------------------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """Seed bytes with a few byte overwrites, an insertion or deletion, and maybe truncation."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(0, 6))):
        if not data:
            break
        kind = draw(st.sampled_from(["set", "set", "insert", "delete", "flip"]))
        i = draw(st.integers(0, len(data) - 1))
        if kind == "set":
            data[i] = draw(st.integers(0, 255))
        elif kind == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[i : i + draw(st.integers(1, 16))]
    if draw(st.booleans()) and data:
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def mutated_json(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    """A JSON document with some fields (nested one level) replaced, deleted or added."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 4))):
        target = doc
        nested = [k for k, v in doc.items() if isinstance(v, dict)]
        if nested and draw(st.booleans()):
            target = doc[draw(st.sampled_from(sorted(nested)))]
        keys = sorted(target)
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "add" or not keys:
            target[draw(st.text(max_size=8))] = draw(JSON_VALUES)
        elif action == "delete":
            del target[draw(st.sampled_from(keys))]
        else:
            target[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
    return json.dumps(doc)


# ---- seeds -----------------------------------------------------------------------------------------------


def tiny_model() -> vitkit.VisionTransformer:
    return vitkit.create_model(
        "Ti/16", image_size=8, patch_size=4, hidden_size=8, depth=2, num_heads=2, mlp_dim=16, num_classes=3,
        gelu="tanh",
    )  # fmt: skip


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("seeds")
    model = tiny_model()
    out: dict[str, Any] = {}
    v = vitkit.save_pretrained(model, root / "v", class_names=["a", "b", "c"])
    out["vitkit_config"] = json.loads((v / "config.json").read_text())
    out["vitkit_weights"] = (v / "model.safetensors").read_bytes()
    hf = save_checkpoint(model, root / "hf", "hf")
    out["hf_config"] = json.loads((hf / "config.json").read_text())
    out["hf_weights"] = (hf / "model.safetensors").read_bytes()
    out["official"] = (FIXTURES / "official_vit_tiny.npz").read_bytes()
    out["timm"] = save_checkpoint(model, root / "t.safetensors", "timm").read_bytes()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(sd, buf)
    out["pth"] = buf.getvalue()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
    for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"):
        b = io.BytesIO()
        Image.fromarray(pixels).save(b, format=fmt)
        out[f"image_{fmt}"] = b.getvalue()
    meta = {b"label_names": [b"cat", b"dog"]}
    batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 1, 0]}
    out["cifar_meta"] = pickle.dumps(meta, protocol=2)
    out["cifar_batch"] = pickle.dumps(batch, protocol=2)
    b = io.BytesIO()
    np.savez(b, x_train=rng.integers(0, 256, (4, 8, 8), dtype=np.uint8), y_train=np.array([0, 1, 0, 1]))
    out["npz_data"] = b.getvalue()
    out["labels_json"] = json.dumps([[0], [1, 2], [], [2]])
    out["labels_csv"] = "index,labels\n0,0\n1,1 2\n2,\n3,2\n"
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as tf:
        for i in range(3):
            for name, data in ((f"{i:04d}.png", out["image_PNG"]), (f"{i:04d}.cls", str(i % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    out["tar"] = b.getvalue()
    return out


def fast_or_slow(n_fast: int) -> Callable[[Any], Any]:
    """Hypothesis settings: a small derandomised run in the default suite; the slow profile runs 20x more."""
    return settings(
        max_examples=n_fast,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---- the loaders ---------------------------------------------------------------------------------------


def _write(folder: Path, files: dict[str, bytes | str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return folder


def checkpoint_case(tmp: Path, seeds: dict[str, Any], kind: str, data: st.DataObject) -> Path:
    if kind == "vitkit_config":
        cfg = data.draw(mutated_json(seeds["vitkit_config"]))
        return _write(tmp / "c", {"config.json": cfg, "model.safetensors": seeds["vitkit_weights"]})
    if kind == "vitkit_weights":
        w = data.draw(mutated(seeds["vitkit_weights"]))
        return _write(tmp / "c", {"config.json": json.dumps(seeds["vitkit_config"]), "model.safetensors": w})
    if kind == "hf_config":
        cfg = data.draw(mutated_json(seeds["hf_config"]))
        return _write(tmp / "c", {"config.json": cfg, "model.safetensors": seeds["hf_weights"]})
    name = {"official": "c.npz", "timm": "c.safetensors", "pth": "c.pth"}[kind]
    (tmp / name).write_bytes(data.draw(mutated(seeds[kind])))
    return tmp / name


CHECKPOINT_KINDS = ["vitkit_config", "vitkit_weights", "hf_config", "official", "timm", "pth"]


def run_checkpoint_fuzz(seeds: dict[str, Any], tmp_path: Path, n: int) -> None:
    counter = iter(range(10**9))

    @settings(parent=fast_or_slow(n))
    @given(data=st.data(), kind=st.sampled_from(CHECKPOINT_KINDS))
    def check(data: st.DataObject, kind: str) -> None:
        tmp = tmp_path / str(next(counter))
        tmp.mkdir()
        path = checkpoint_case(tmp, seeds, kind, data)

        def load() -> None:
            loaded = load_checkpoint(path)
            with torch.no_grad():
                loaded.model(torch.zeros(1, loaded.model.cfg.in_channels, *loaded.model.cfg.image_size))

        allowed(load)

    t0 = time.perf_counter()
    check()
    print(f"\ncheckpoint fuzz: {dict(OUTCOMES)} in {time.perf_counter() - t0:.1f} s")
    OUTCOMES.clear()


def run_data_fuzz(seeds: dict[str, Any], tmp_path: Path, n: int) -> None:
    counter = iter(range(10**9))
    kinds = [k for k in seeds if k.startswith("image_")] + ["cifar", "npz_data", "labels_json", "labels_csv", "tar"]

    @settings(parent=fast_or_slow(n))
    @given(data=st.data(), kind=st.sampled_from(kinds))
    def check(data: st.DataObject, kind: str) -> None:
        tmp = tmp_path / str(next(counter))
        tmp.mkdir()
        if kind.startswith("image_"):
            path = tmp / f"x.{kind[6:].lower()}"
            path.write_bytes(data.draw(mutated(seeds[kind])))
            allowed(lambda: load_image(path).load())
        elif kind == "cifar":
            which = data.draw(st.sampled_from(["batches.meta", "data_batch_1"]))
            files = {"batches.meta": seeds["cifar_meta"], **{f"data_batch_{i}": seeds["cifar_batch"] for i in (1, 2)}}
            files.update({"data_batch_3": seeds["cifar_batch"], "data_batch_4": seeds["cifar_batch"]})
            files.update({"data_batch_5": seeds["cifar_batch"], "test_batch": seeds["cifar_batch"]})
            files[which] = data.draw(mutated(seeds[f"cifar_{'meta' if which == 'batches.meta' else 'batch'}"]))
            folder = _write(tmp / "cifar", files)
            allowed(lambda: [open_dataset(str(folder), "train")[i] for i in range(2)])
        elif kind == "npz_data":
            path = tmp / "d.npz"
            path.write_bytes(data.draw(mutated(seeds[kind])))
            allowed(lambda: [open_dataset(str(path), "train")[i] for i in range(2)])
        elif kind.startswith("labels_"):
            text = data.draw(mutated(seeds[kind].encode()))
            path = tmp / ("l.json" if kind == "labels_json" else "l.csv")
            path.write_bytes(text)
            allowed(lambda: read_label_sets(path, 4, None))
        else:
            path = tmp / "s.tar"
            path.write_bytes(data.draw(mutated(seeds[kind])))
            allowed(lambda: [open_dataset(str(path), "train")[i] for i in range(2)])

    t0 = time.perf_counter()
    check()
    print(f"\ndata fuzz: {dict(OUTCOMES)} in {time.perf_counter() - t0:.1f} s")
    OUTCOMES.clear()


def test_fuzz_checkpoint_loaders(seeds: dict[str, Any], tmp_path: Path) -> None:
    run_checkpoint_fuzz(seeds, tmp_path, 150)


def test_fuzz_data_loaders(seeds: dict[str, Any], tmp_path: Path) -> None:
    run_data_fuzz(seeds, tmp_path, 200)


@pytest.mark.slow
def test_fuzz_checkpoint_loaders_long(seeds: dict[str, Any], tmp_path: Path) -> None:
    run_checkpoint_fuzz(seeds, tmp_path, 1200)


@pytest.mark.slow
def test_fuzz_data_loaders_long(seeds: dict[str, Any], tmp_path: Path) -> None:
    run_data_fuzz(seeds, tmp_path, 1600)
