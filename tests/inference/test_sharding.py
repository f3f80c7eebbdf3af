"""Sharding under torchrun: 2 gloo processes give ``vitkit predict``, ``embed``, ``eval`` and ``knn`` the same
output files and metrics as 1 process (each process its share of the images, process 0 writing in input order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vitkit
from helpers import SRC, randomize_
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.distributed import DistInfo, shard_steps
from vitkit.models import create_model
from vitkit.outputs.array_reader import read_embeddings

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def test_shards_are_disjoint_cover_the_input_and_step_together() -> None:
    positions = list(range(3, 26))  # 23 positions, e.g. what a resumed run has left
    shares = [shard_steps(positions, 4, DistInfo(rank=r, world=3)) for r in range(3)]
    assert sorted(p for mine, _ in shares for p in mine) == positions
    assert {steps for _, steps in shares} == {2}  # ceil(23 / (4 * 3)): every process runs the same steps
    for s in range(2):  # each step of all processes together: consecutive positions of the input
        step = sorted(p for mine, _ in shares for p in mine[4 * s : 4 * (s + 1)])
        assert step == positions[12 * s : 12 * (s + 1)]


@pytest.mark.slow  # ~40 s on 2 cores: three interpreters importing torch, five commands each
def test_two_gloo_processes_equal_one_process(tmp_path: Path) -> None:
    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=2, num_heads=2,
                                    mlp_dim=32, num_classes=3))  # fmt: skip
    ckpt = vitkit.save_pretrained(model.eval(), tmp_path / "m", preprocess=Preprocess(image_size=16),
                                  class_names=["a", "b", "c"])  # fmt: skip
    data = tmp_path / "data"
    for split, n in (("train", 6), ("test", 5)):  # 15 test images: the processes' last steps are uneven
        for c, name in enumerate("abc"):
            (data / split / name).mkdir(parents=True)
            for i in range(n):
                rng = np.random.default_rng(hash((split, c, i)) % 2**32)
                img = rng.integers(0, 256, (14, 20, 3), dtype=np.uint8) // (c + 1)
                Image.fromarray(img.astype(np.uint8)).save(data / split / name / f"{i}.png")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, launcher in (
        (one, [sys.executable]),
        (two, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]),
    ):
        out.mkdir()
        proc = subprocess.run([*launcher, str(HERE / "shard_run.py"), str(out), str(ckpt), str(data)], env=ENV,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert (one / "pred.jsonl").read_bytes() == (two / "pred.jsonl").read_bytes()
    assert [json.loads(r)["index"] for r in (two / "pred.jsonl").read_text().splitlines()] == list(range(15))
    for name in ("emb.npy", "tokens.parquet"):
        a, b = read_embeddings(one / name), read_embeddings(two / name)
        np.testing.assert_array_equal(a.vectors, b.vectors)
        assert a.ids == b.ids and a.labels.tolist() == b.labels.tolist() and b.index.tolist() == list(range(15))
    assert (one / "eval" / "metrics.json").read_text() == (two / "eval" / "metrics.json").read_text()
    assert (one / "eval" / "confusion.csv").read_text() == (two / "eval" / "confusion.csv").read_text()
    knn_one, knn_two = (json.loads((d / "knn.json").read_text()) for d in (one, two))
    assert knn_one == knn_two and knn_one["num_test"] == 15 and knn_one["num_train"] == 18
    assert not list(two.glob("*.parts"))  # assembled, chunk folders removed


@pytest.mark.slow  # ~15 s on 2 cores: two interpreters importing torch under torchrun, twice
@pytest.mark.parametrize("command", ["predict", "embed", "eval"])
def test_processes_that_list_different_inputs_stop_in_one_line(tmp_path: Path, command: str) -> None:
    """Two gloo processes, each given its own folder (process 1's has one image more, and another name): every
    process refuses in one line before any step (before: the processes' step counts differed and the job hung
    until the process group's 30-minute timeout; equal counts mixed two inputs' rows in one output)."""
    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=1, num_heads=2,
                                    mlp_dim=32, num_classes=1))  # fmt: skip
    ckpt = vitkit.save_pretrained(model.eval(), tmp_path / "m", preprocess=Preprocess(image_size=16))
    root = tmp_path / "inputs"
    for rank, n in ((0, 5), (1, 6)):
        for i in range(n):
            folder = root / str(rank) / "test" / "a"  # an ImageFolder (embed --data) and a folder (predict)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(folder / f"{rank}-{i}.png")
    out = tmp_path / "out"
    out.mkdir()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*launcher, str(HERE / "mismatch_run.py"), str(out), str(ckpt), str(root), command],
                          env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "every process must see the same input" in line]
    # one line from each process (torchrun may stop the second before it prints once the first has exited)
    assert 1 <= len(lines) <= 2 and all(line.startswith(f"vitkit {command}: error: ") for line in lines), proc.stderr
    assert "process 1 of 2 lists 6 images" in lines[0] and "process 0 lists 5" in lines[0]
    written = out / {"predict": "pred.jsonl", "embed": "emb.npy", "eval": "eval"}[command]
    assert not written.exists() or (written.is_file() and written.stat().st_size == 0), list(out.iterdir())
