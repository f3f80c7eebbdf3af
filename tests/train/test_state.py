"""Atomic checkpoint writes, keep-last-k, crashes during a save, optimiser state round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from vitkit.errors import CheckpointError
from vitkit.train import state as ck


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((3, 4), v), "optim/w/step": torch.tensor(v)}


def test_keep_last_k_and_latest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        ck.write_state(tmp_path, step, _state(step), {"note": step}, keep_last=2)
    assert [s for s, _ in ck.list_states(tmp_path)] == [15, 20]
    tensors, meta = ck.read_state(ck.latest_state(tmp_path))  # type: ignore[arg-type]
    assert meta["step"] == 20 and meta["note"] == 20 and torch.equal(tensors["model/w"], torch.full((3, 4), 20.0))
    assert tensors["optim/w/step"].shape == ()  # 0-d tensors survive safetensors
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    # the same step written again (after a resume) replaces it
    ck.write_state(tmp_path, 20, _state(-1), {}, keep_last=2)
    assert torch.equal(ck.read_state(tmp_path / "step-000000020")[0]["model/w"], torch.full((3, 4), -1.0))


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck.write_state(tmp_path, 1, _state(1.0), {}, keep_last=1)

    def half_written(tensors: dict[str, torch.Tensor], path: str, *args: Any) -> None:
        Path(path).write_bytes(b"\x00" * 100)  # a partial file, then the process "dies"
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", half_written)
    with pytest.raises(CheckpointError, match=r"cannot write \(disk full\); its previous contents, if any, are kept"):
        ck.write_state(tmp_path, 2, _state(2.0), {}, keep_last=1)
    assert [s for s, _ in ck.list_states(tmp_path)] == [1]
    tensors, meta = ck.read_state(ck.resolve_resume(tmp_path))
    assert meta["step"] == 1 and torch.equal(tensors["model/w"], torch.full((3, 4), 1.0))


def test_a_killed_writer_leaves_only_ignored_debris(tmp_path: Path) -> None:
    """SIGKILL mid-write cannot run cleanup: the temporary folder stays, but is never mistaken for a checkpoint."""
    ck.write_state(tmp_path, 7, _state(7.0), {}, keep_last=3)
    debris = tmp_path / ".step-000000008.abc123"
    debris.mkdir()
    (debris / ck.TENSORS).write_bytes(b"partial")
    half = tmp_path / "step-000000009"  # even a folder with the final name but missing files is skipped
    half.mkdir()
    (half / ck.TENSORS).write_bytes(b"partial")
    assert ck.latest_state(tmp_path) == tmp_path / "step-000000007"


def test_bad_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no training checkpoint"):
        ck.resolve_resume(tmp_path)
    p = ck.write_state(tmp_path, 3, _state(3.0), {}, keep_last=1)
    (p / ck.META).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="not a vitkit training state"):
        ck.read_state(p)
    (p / ck.META).write_text("{")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        ck.read_state(p)


def test_optimizer_state_round_trip() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        return m, torch.optim.AdamW(m.parameters(), lr=0.1, betas=(0.8, 0.99))

    m, opt = make()
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    opts = StateDictOptions(full_state_dict=True)
    tensors, doc = ck.flatten_optimizer(get_optimizer_state_dict(m, opt, options=opts))
    tensors = {k: v.clone() for k, v in tensors.items()}  # as read back from disk: no aliasing
    doc = json.loads(json.dumps(doc))  # as written to state.json
    m2, opt2 = make()
    m2.load_state_dict(m.state_dict())
    set_optimizer_state_dict(m2, opt2, ck.unflatten_optimizer(tensors, doc), options=opts)
    assert tuple(opt2.param_groups[0]["betas"]) == (0.8, 0.99)
    x = torch.randn(5, 4)
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        model(x).square().sum().backward()
        o.step()
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
