"""No data loss: writers never delete or overwrite what vitkit did not write, never write into their input,
and a folder being replaced is always readable (old or new), even when the writer is SIGKILLed."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from helpers import run_cli
from vitkit import fileio
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError, ConfigError
from vitkit.evaluate.evaluate import EvalReport, write_eval_report
from vitkit.evaluate.metrics import compute_metrics
from vitkit.train import state as ck


def tiny(num_classes: int = 3, value: float | None = None) -> vitkit.VisionTransformer:
    model = vitkit.create_model(
        "Ti/16",
        image_size=8,
        patch_size=4,
        hidden_size=8,
        depth=1,
        num_heads=2,
        mlp_dim=16,
        num_classes=num_classes,
        gelu="tanh",
    )
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return model.eval()


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


def fake_run(root: Path) -> Path:
    """A training run's layout: model/, metrics.csv, checkpoints/."""
    vitkit.save_pretrained(tiny(), root / "model", class_names=["a", "b", "c"])
    (root / "metrics.csv").write_text("epoch,loss\n1,0.5\n")
    ck.write_state(root / "checkpoints", 3, {"model/w": torch.ones(2)}, {})
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_convert_refuses_a_users_folder_and_its_own_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    before = snapshot(run)
    mine = user_folder(tmp_path / "p")
    code, _, err = run_cli(capsys, "convert", str(run), str(mine), "--to", "vitkit")
    assert code == 2 and "notes.txt" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, "convert", str(run), str(mine), "--to", "vitkit", "--overwrite")
    assert code == 2 and "never deletes" in err, err  # --overwrite replaces only vitkit's own checkpoints
    assert (mine / "notes.txt").read_text() == "mine"
    for out in (run, run / "model", run / "sub", tmp_path):  # the input itself, inside it, around it
        code, _, err = run_cli(capsys, "convert", str(run), str(out), "--to", "vitkit", "--overwrite")
        assert code == 2 and "would overwrite the input" in err, (out, err)
    assert snapshot(run) == before


def test_convert_replaces_a_vitkit_checkpoint_only_with_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = fake_run(tmp_path / "run")
    assert run_cli(capsys, "convert", str(run), str(tmp_path / "v"), "--to", "vitkit")[0] == 0
    code, _, err = run_cli(capsys, "convert", str(run), str(tmp_path / "v"), "--to", "vitkit")
    assert code == 2 and "--overwrite" in err
    assert run_cli(capsys, "convert", str(run), str(tmp_path / "v"), "--to", "hf", "--overwrite")[0] == 0
    assert vitkit.checkpoints.detect_format(tmp_path / "v") == "hf"
    for target in ("o.npz", "t.safetensors"):  # files: refused when present, replaced with --overwrite
        fmt = "official" if target.endswith(".npz") else "timm"
        (tmp_path / target).write_bytes(b"user data")
        code, _, err = run_cli(capsys, "convert", str(tmp_path / "v"), str(tmp_path / target), "--to", fmt)
        assert code == 2 and "already exists" in err and (tmp_path / target).read_bytes() == b"user data"
        args = ("convert", str(tmp_path / "v"), str(tmp_path / target), "--to", fmt, "--overwrite")
        assert run_cli(capsys, *args)[0] == 0
        assert vitkit.checkpoints.detect_format(tmp_path / target) == fmt
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


@pytest.mark.parametrize("first", ["timm", "hf", "vitkit"])
def test_convert_overwrite_replaces_a_folder_vitkit_wrote_in_any_format(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, first: str
) -> None:
    """Issue 25 item 17: ``convert M out --to vitkit --overwrite`` over the folder ``--to timm`` (or hf) wrote
    there was refused as "not a vitkit checkpoint vitkit wrote". Every folder format vitkit writes is vitkit's to
    replace, by every other; a user's file in it still stops the replacement and is kept."""
    src = tmp_path / "src"
    vitkit.save_pretrained(tiny(), src, class_names=["a", "b", "c"])
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", str(src), str(out), "--to", first)[0] == 0
    for fmt in ("vitkit", "hf", "timm"):
        if fmt == first:
            continue
        code, _, err = run_cli(capsys, "convert", str(src), str(out), "--to", fmt)
        assert code == 2 and "--overwrite" in err, err  # it is vitkit's, but replacing it needs the flag
        code, _, err = run_cli(capsys, "convert", str(src), str(out), "--to", fmt, "--overwrite")
        assert code == 0, err
        assert vitkit.checkpoints.detect_format(out) == fmt
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", str(src), str(out), "--to", first, "--overwrite")
    assert code == 2 and "notes.txt" in err and (out / "notes.txt").read_text() == "mine"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_save_pretrained_never_deletes_foreign_files(tmp_path: Path) -> None:
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt"):
        vitkit.save_pretrained(tiny(), mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine"
    vitkit.save_pretrained(tiny(value=0.1), tmp_path / "m")
    with pytest.raises(CheckpointError, match="overwrite"):
        vitkit.save_pretrained(tiny(value=0.2), tmp_path / "m")
    vitkit.save_pretrained(tiny(value=0.2), tmp_path / "m", overwrite=True)
    assert float(vitkit.load_pretrained(tmp_path / "m").norm.weight[0].detach()) == pytest.approx(0.2)
    (tmp_path / "m" / "README.md").write_text("my notes about this model")  # a user's file in vitkit's folder
    with pytest.raises(CheckpointError, match=r"README\.md"):
        vitkit.save_pretrained(tiny(), tmp_path / "m", overwrite=True)
    assert (tmp_path / "m" / "README.md").is_file()
    (tmp_path / "empty").mkdir()  # an empty folder is fine to write into
    vitkit.save_pretrained(tiny(), tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        vitkit.save_pretrained(tiny(), tmp_path / "file", overwrite=True)


def test_every_folder_format_refuses_foreign_folders(tmp_path: Path) -> None:
    hub = tmp_path / "hub"  # e.g. a folder downloaded from the hub: not vitkit's to replace
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (hub / "model.safetensors").write_bytes(b"\x00" * 16)
    for fmt in ("vitkit", "hf", "timm"):
        with pytest.raises(CheckpointError, match=r"not a checkpoint folder vitkit wrote|not a vitkit checkpoint"):
            save_checkpoint(tiny(), hub, fmt, overwrite=True)
    assert (hub / "model.safetensors").read_bytes() == b"\x00" * 16
    loaded = load_checkpoint(save_checkpoint(tiny(), tmp_path / "v"))
    with pytest.raises(CheckpointError, match="would overwrite the input"):
        save_checkpoint(loaded.model, tmp_path / "v", "hf", meta=loaded.meta, overwrite=True)


def test_report_folders_keep_foreign_files(tmp_path: Path) -> None:
    logits, labels = torch.randn(6, 3).numpy(), np.array([0, 1, 2, 0, 1, 2])
    report = EvalReport(compute_metrics(logits, labels, 3), ["a", "b", "c"])
    write_eval_report(report, tmp_path / "e")
    write_eval_report(report, tmp_path / "e")  # an earlier report is replaced
    (tmp_path / "e" / "mine.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"mine\.txt"):
        write_eval_report(report, tmp_path / "e")
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.json").write_text('{"loss": 1}')  # same name, not an eval report
    with pytest.raises(ConfigError, match=r"metrics\.json"):
        write_eval_report(report, other)
    assert (other / "metrics.json").read_text() == '{"loss": 1}'


# ---- the replace window -------------------------------------------------------------------------------


def test_readers_use_the_old_folder_between_the_two_renames(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    aside = fileio.temp_path(run / "model", "old")
    os.replace(run / "model", aside)  # the state after the first rename of a replace
    assert load_checkpoint(run).model.cfg.num_classes == 3
    assert load_checkpoint(run / "model").model.cfg.num_classes == 3
    unfinished = fileio.temp_path(run / "model")
    unfinished.mkdir()  # an unfinished new version
    (run / ".notes").mkdir()  # not a name vitkit makes: left alone
    done = fileio.clean_stale(run, ("model", "best"))
    assert (run / "model" / "model.safetensors").is_file() and not aside.exists()
    assert not unfinished.exists() and (run / ".notes").is_dir() and len(done) == 2


def test_checkpoint_folder_leftovers_are_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        ck.write_state(root, step, {"model/w": torch.full((2,), float(step))}, {}, keep_last=3)
    aside = fileio.temp_path(root / "step-000000002", "old")
    os.replace(root / "step-000000002", aside)  # re-save of step 2 interrupted
    assert ck.latest_state(root) == aside
    (root / "step-000000003").mkdir()  # a prune cut short / an empty step folder
    fileio.temp_path(root / "step-000000004").mkdir()
    fileio.temp_path(root / "step-000000001", "del").mkdir()
    ck.clean_states(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001", "step-000000002"]


def _writer_loop(out: Path, kill_in_window: bool, models: list[vitkit.VisionTransformer]) -> None:
    """Child body: replace ``out`` with alternating versions forever (or SIGKILL itself between renames)."""
    if kill_in_window:
        real = os.replace

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            if Path(dst) == out and not out.exists():
                os.kill(os.getpid(), signal.SIGKILL)  # old version moved aside, new one not yet in place
            real(src, dst)

        os.replace = replace  # type: ignore[assignment]
    i = 0
    while True:
        vitkit.save_pretrained(models[i % 2], out, overwrite=True)
        i += 1


def _fork_writer(out: Path, kill_in_window: bool, models: list[vitkit.VisionTransformer]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            _writer_loop(out, kill_in_window, models)
        finally:
            os._exit(1)
    return pid


@pytest.mark.parametrize("kills", [30])
def test_sigkill_during_replace_always_leaves_a_loadable_model(tmp_path: Path, kills: int) -> None:
    """Real SIGKILLs of a process that keeps replacing a model folder: at random moments, and exactly
    between the two renames. After each, a reader loads a complete model (the old or the new one)."""
    out = tmp_path / "model"
    vitkit.save_pretrained(tiny(value=0.25), out)
    models = [tiny(value=0.25), tiny(value=0.5)]
    rng = random.Random(0)
    in_window = 0
    for k in range(kills):
        targeted = k % 3 == 0
        pid = _fork_writer(out, targeted, models)
        if not targeted:
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        in_window += not out.exists()
        value = float(load_checkpoint(out).model.norm.weight[0].detach())
        assert value in (0.25, 0.5)
        fileio.clean_stale(tmp_path, ("model",))  # what the next start does
        assert out.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert in_window >= kills // 3  # the targeted kills did land between the renames
