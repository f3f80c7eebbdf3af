"""``vitkit index --add`` and ``--remove`` killed with SIGKILL at random points of their write: the index left is
loadable and equal to a from-scratch build of the old ids or of the new ones (never a mixture), and running the
command again completes it (equal to a from-scratch build of all ids)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from search_helpers import clustered, ids

from helpers import SRC
from vitkit.outputs.arrays import EmbeddingWriter
from vitkit.search import Index

N_OLD, N_NEW, DIM = 20_000, 20_000, 96


def _embeddings(path: Path, names: list[str], vectors: np.ndarray) -> Path:
    meta = {"vitkit.checkpoint": "cd" * 32, "vitkit.embed.pool": "pre-logits", "vitkit.embed.layer": "final",
            "vitkit.embed.shape": f"[{DIM}]"}  # fmt: skip
    w = EmbeddingWriter(path, meta)
    for s in range(0, len(names), 5000):
        part = names[s : s + 5000]
        w.write({"index": np.arange(s, s + len(part)), "id": part, "label": np.full(len(part), -1),
                 "vector": vectors[s : s + len(part)], "error": [""] * len(part)})  # fmt: skip
    w.close()
    w.release()
    return path


def _same(a: Index, b: Index) -> bool:
    return a.ids == b.ids and np.array_equal(a.vectors, b.vectors) and a.provenance == b.provenance


def _temp_dirs(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".vitkit-" in p.name]


def _trial(tmp: Path, seed: int, op: str) -> None:
    rng = random.Random(seed)
    data = clustered(N_OLD + N_NEW, DIM, seed=seed)
    old = _embeddings(tmp / "old.npy", ids(N_OLD), data[:N_OLD])
    new = _embeddings(tmp / "new.npy", ids(N_NEW, N_OLD), data[N_OLD:])
    before = Index.from_embeddings(old)
    after = Index.from_embeddings(old)
    if op == "add":
        after.add_embeddings(new)
        argv = ["index", "--add", str(new), str(tmp / "ix")]
        before.save(tmp / "ix")
    else:
        after.add_embeddings(new)
        before, after = after, Index.from_embeddings(new)
        (tmp / "gone.txt").write_text("\n".join(ids(N_OLD)) + "\n")
        argv = ["index", "--remove", str(tmp / "gone.txt"), str(tmp / "ix")]
        before.save(tmp / "ix")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "vitkit", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while not _temp_dirs(tmp) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)  # the write has begun: its private folder beside the index
    time.sleep(rng.uniform(0.0, 0.08))  # the write of 40k x 96 vectors takes about this long
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = Index.open(tmp / "ix")
    assert _same(left, before) or _same(left, after), f"seed {seed}: the killed {op} left a mixture"
    run = subprocess.run([sys.executable, "-m", "vitkit", *argv], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    done = Index.open(tmp / "ix")
    assert _same(done, after), f"seed {seed}: the rerun did not complete the {op}"
    assert not _temp_dirs(tmp), "a rerun cleans what the kill left"
    assert not list((tmp).glob(".ix.embed*"))


@pytest.mark.parametrize(("seed", "op"), [(0, "add"), (1, "add"), (2, "remove")])
def test_kill_during_add_or_remove_leaves_old_or_new(tmp_path: Path, seed: int, op: str) -> None:
    _trial(tmp_path, seed, op)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 23))
def test_kill_during_add_twenty_trials(tmp_path: Path, seed: int) -> None:
    _trial(tmp_path, seed, "add" if seed % 4 else "remove")
