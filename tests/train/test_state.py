"""Training state: atomic writes, keep-last-k, a failed write, a real SIGKILL during a save, optimiser round trip."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from train_helpers import assert_same_weights, tiny_config, weights

from helpers import SRC, file_modes, umask_modes
from vitkit.errors import CheckpointError
from vitkit.train import state as ck
from vitkit.train import train

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}


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


def test_a_failed_write_is_one_line_and_keeps_the_previous_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while writing (a full disk): one line naming the folder, the temporary removed, the previous
    state still the one to resume from. (A process killed mid-write is tested for real below.)"""
    ck.write_state(tmp_path, 1, _state(1.0), {}, keep_last=1)

    def half_written(tensors: dict[str, torch.Tensor], path: str, *args: Any) -> None:
        Path(path).write_bytes(b"\x00" * 100)  # a partial file, then the disk is full
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", half_written)
    with pytest.raises(CheckpointError, match=r"cannot write \(disk full\); its previous contents, if any, are kept"):
        ck.write_state(tmp_path, 2, _state(2.0), {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]
    tensors, meta = ck.read_state(ck.resolve_resume(tmp_path))
    assert meta["step"] == 1 and torch.equal(tensors["model/w"], torch.full((3, 4), 1.0))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of the run the kill test's worker makes, not interrupted."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(checkpoint_every_steps=3), run, progress=False)
    return weights(run / "model")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid-write", "before-rename"])
def test_sigkill_while_saving_keeps_the_previous_state(
    tmp_path: Path, point: str, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """A real training process (kill_save_run.py) SIGKILLed inside its second save of training state (step 6):
    half-way through writing state.safetensors, or with the new state complete but not yet renamed into place.
    The step-3 state stays the one to resume from and loads; the new one, half-written or whole, is never taken
    for a state; resuming removes it and ends with exactly the weights of an uninterrupted run."""
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "kill_save_run.py"), str(run), point],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline()  # the worker has stopped inside the save when it prints
        assert line, child.stderr.read()[-4000:]
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
        child.communicate()
    root = run / "checkpoints"
    assert not (run / "model").exists()  # it died in the middle of training
    assert [s for s, _ in ck.list_states(root)] == [3]
    tensors, meta = ck.read_state(ck.resolve_resume(run))
    assert meta["step"] == 3 and meta["config"]["checkpoint_every_steps"] == 3 and "model/head.weight" in tensors
    [partial] = [p for p in root.iterdir() if p.name.startswith(".step-000000006.vitkit-tmp-")]
    if point == "mid-write":
        expected = int(line.split()[-1])
        assert (partial / ck.TENSORS).stat().st_size == expected // 2 and not (partial / ck.META).exists()
        with pytest.raises(SafetensorError):
            load_file(partial / ck.TENSORS)
    else:
        assert ck.read_state(partial)[1]["step"] == 6  # complete, but not yet a state: the rename commits it

    resumed = train(resume=run, progress=False)
    assert resumed.steps[0]["step"] == 4 and resumed.step == 22
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert_same_weights(uninterrupted, weights(run / "model"))


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


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_a_training_run_folder_gets_the_umask_mode(tmp_path: Path, umask: int) -> None:
    """A real (tiny) run: model/, checkpoints/step-*, its config and logs all get 0666 & ~umask (folders
    0777 & ~umask); safetensors' save_file alone made the weights 0600 beside a 0644 config (issue 25, 18)."""
    old = os.umask(umask)
    try:
        train(tiny_config(epochs=1), tmp_path / "run", progress=False)
    finally:
        os.umask(old)
    run = tmp_path / "run"
    assert (run / "model" / "model.safetensors").is_file() and any((run / "checkpoints").iterdir())
    assert file_modes(run) == umask_modes(run, umask)
