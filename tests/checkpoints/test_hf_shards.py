"""A Hugging Face folder's ``model.safetensors.index.json`` names its shards inside the folder, as regular
files (issue 47, item 6): an absolute path, a ``..``, a linked folder leading out, or a FIFO is refused in one
line before anything is opened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from vitkit.checkpoints import save_checkpoint
from vitkit.errors import CheckpointError


def sharded_hf(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A small HF folder whose weights are split over two shards named by an index; (folder, weight map)."""
    model = vitkit.create_model("Ti/16", image_size=32, patch_size=8, hidden_size=32, depth=1, num_heads=2,
                                mlp_dim=32, num_classes=3)  # fmt: skip
    folder = save_checkpoint(model.eval(), tmp_path / "hf", "hf")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(folder / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    return folder, weight_map


def write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_shards_inside_the_folder_load(tmp_path: Path) -> None:
    folder, weight_map = sharded_hf(tmp_path)
    sub = folder / "weights"
    sub.mkdir()
    (folder / "b.safetensors").rename(sub / "b.safetensors")
    write_index(folder, {k: ("weights/b.safetensors" if v == "b.safetensors" else v) for k, v in weight_map.items()})
    model = vitkit.load_pretrained(folder)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "linked folder"])
def test_a_shard_outside_the_folder_is_refused(tmp_path: Path, how: str) -> None:
    folder, weight_map = sharded_hf(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / "b.safetensors").rename(elsewhere / "b.safetensors")  # a loadable file, just not the folder's
    name = {
        "absolute": str(elsewhere / "b.safetensors"),
        "dotdot": "../elsewhere/b.safetensors",
        "linked folder": "out/b.safetensors",
    }[how]
    (folder / "out").symlink_to(elsewhere)
    write_index(folder, {k: (name if v == "b.safetensors" else v) for k, v in weight_map.items()})
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors\.index\.json: shard .* (not a file name inside|lies outside)"
    ):
        vitkit.load_pretrained(folder)


def test_a_fifo_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    """``vitkit info`` on the folder, in a process of its own (a blocked open() could not be undone in this one)."""
    folder, weight_map = sharded_hf(tmp_path)
    (folder / "b.safetensors").unlink()
    os.mkfifo(folder / "b.safetensors")
    write_index(folder, weight_map)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitkit", "info", str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # vitkit and anything it started, all blocked on the FIFO
        proc.communicate()
        pytest.fail("vitkit info blocked on a FIFO named by the shard index")
    err = err.strip()
    assert proc.returncode == 2 and err.count("\n") == 0, err
    assert "b.safetensors" in err and "not a regular file" in err
