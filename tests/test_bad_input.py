"""Bad input ends in one line naming the file or option, exit status 2, never a traceback (issue 13, items 5-7)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import SRC, randomize_, run_cli
from vitkit.checkpoints.vitkit_format import save
from vitkit.models import create_model


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run_cli(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:") and "%|" not in ln]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = create_model("Ti/16", patch_size=4, image_size=16, hidden_size=32, depth=1, num_heads=2, mlp_dim=64,
                         num_classes=2)  # fmt: skip
    randomize_(model)
    return save(model.eval(), tmp_path_factory.mktemp("ck") / "model", class_names=["a", "b"])


def _edited(src: Path, dst: Path, cfg: Callable[[dict[str, Any]], None] | None = None,
            state: Callable[[dict[str, torch.Tensor]], None] | None = None) -> str:  # fmt: skip
    dst.mkdir()
    doc = json.loads((src / "config.json").read_text())
    if cfg is not None:
        cfg(doc["model"])
    (dst / "config.json").write_text(json.dumps(doc))
    tensors = load_file(str(src / "model.safetensors"))
    if state is not None:
        state(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


CORRUPTIONS: dict[str, tuple[Callable[..., Any] | None, Callable[..., Any] | None, str]] = {
    "missing fields": (lambda m: [m.pop("hidden_size"), m.pop("depth")], None, "lacks hidden_size, depth"),
    "patch size -4": (lambda m: m.update(patch_size=-4), None, "patch_size -4 is outside 1..4096"),
    "hidden size overflow": (
        lambda m: m.update(hidden_size=2**62, num_heads=1),
        None,
        "hidden_size 4611686018427387904 is outside",
    ),
    "wrong type": (lambda m: m.update(hidden_size="32"), None, "hidden_size must be an integer, got '32'"),
    "NaN eps": (lambda m: m.update(layer_norm_eps=float("nan")), None, "layer_norm_eps must be a finite number"),
    # a key of the file's own that would break the line (found by the checkpoint fuzzer): quoted printable
    "a key with a newline": (lambda m: m.update({"\n": None}), None, "unknown ViT config keys: \\x0a"),
    # the descendants' options (models/config.py): an unknown activation, a bad register count, RoPE beside a
    # learned position embedding, a layer scale that is not a number, registers the weights do not hold
    "unknown activation": (lambda m: m.update(gelu="swish"), None, "gelu must be one of 'exact', 'tanh', 'quick'"),
    "negative registers": (lambda m: m.update(num_registers=-1), None, "num_registers must be an integer in 0..1024"),
    "rope with learned positions": (lambda m: m.update(rope="dinov3"), None, "pos_embed must be 'none'"),
    "layer scale a string": (lambda m: m.update(layer_scale="1e-5"), None, "layer_scale must be a finite number"),
    "registers not in the weights": (
        lambda m: m.update(num_registers=4),
        lambda t: None,  # the weights as saved: read by predict (info reads the config only)
        'weights do not match the config (Missing key(s) in state_dict: "reg_token"',
    ),
    "truncated register tensor": (
        lambda m: m.update(num_registers=4),
        lambda t: t.update(reg_token=torch.zeros(1, 3, 32)),
        "weights do not match the config (size mismatch for reg_token",
    ),
    "shape mismatch": (
        None,
        lambda t: t.update({"head.weight": torch.zeros(3, 3)}),
        "weights do not match the config (size mismatch for head.weight",
    ),
    "extra tensor": (
        None,
        lambda t: t.update(surprise=torch.zeros(2)),
        'weights do not match the config (Unexpected key(s) in state_dict: "surprise"',
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
@pytest.mark.parametrize("command", ["info", "predict"])
def test_a_broken_checkpoint_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, sample_jpeg: Path, case: str, command: str
) -> None:
    cfg, state, needle = CORRUPTIONS[case]
    bad = _edited(ckpt, tmp_path / "bad", cfg, state)
    argv = ["info", bad] if command == "info" else ["predict", "-c", bad, str(sample_jpeg)]
    if command == "info" and state is not None:
        argv = ["predict", "-c", bad, str(sample_jpeg)]  # info reads the config only
    line = one_line_error(capsys, *argv)
    assert bad in line and needle in line, line


def test_a_foreign_pickle_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, sample_jpeg: Path) -> None:
    import numpy as np

    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    torch.save({"w": np.arange(3)}, folder / "pytorch_model.bin")
    line = one_line_error(capsys, "predict", "-c", str(folder), str(sample_jpeg))
    assert f"{folder / 'pytorch_model.bin'}: not a readable weights-only PyTorch checkpoint" in line
    assert "numpy" in line and len(line) < 300


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
        (["train", "--workers", "-3"], "argument --workers: must be 0 or more, got -3"),
        (["eval", "CKPT", "--data", "digits", "--workers", "-3"], "argument --workers: must be 0 or more"),
    ],
)
def test_negative_seeds_and_workers_are_refused(
    capsys: pytest.CaptureFixture[str], ckpt: Path, argv: list[str], needle: str
) -> None:
    line = one_line_error(capsys, *[str(ckpt) if a == "CKPT" else a for a in argv])
    assert needle in line


@pytest.mark.parametrize("command", ["train", "finetune"])  # eval --out: tests/evaluate
def test_out_that_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, command: str) -> None:
    f = tmp_path / "taken"
    f.write_text("mine")
    argv = {
        "train": ["train", "--steps", "1", "--out", str(f), "--quiet"],
        "finetune": ["finetune", str(ckpt), "--data", "digits", "--steps", "1", "--out", str(f), "--quiet"],
    }[command]
    line = one_line_error(capsys, *argv)
    assert f"{f}: exists and is not a folder" in line and f.read_text() == "mine"


def test_a_failing_disk_is_one_line_and_keeps_the_old_output(tmp_path: Path, ckpt: Path) -> None:
    """A real write failure: the file-size limit (RLIMIT_FSIZE) makes the kernel refuse the weights (EFBIG)."""
    out = tmp_path / "copy"
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
        "from vitkit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    assert resource and signal  # the child uses them
    p = subprocess.run(
        [sys.executable, "-c", code, "convert", str(ckpt), str(out), "--to", "vitkit"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{out}: cannot write (" in lines[0], p.stderr
    assert not out.exists() and not [e for e in tmp_path.iterdir() if e.name.startswith(".copy")]


def test_a_closed_pipe_ends_quietly() -> None:
    p = subprocess.run(
        f"{sys.executable} -m vitkit info B/16 --json | head -1",
        shell=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)},
        executable="/bin/bash", timeout=120,
    )  # fmt: skip
    assert p.stdout == "{\n" and p.stderr == "", p.stderr


def test_eval_warns_when_class_names_differ(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path) -> None:
    import numpy as np
    from PIL import Image

    for cls in ("x", "y"):
        (tmp_path / "d" / "test" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(tmp_path / "d" / "test" / cls / f"{i}.png")
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "ev"))
    assert code == 0
    assert "WARNING: the dataset's class names differ from the checkpoint's at 2 of 2 indices" in err
    assert "'x' vs 'a'" in err
    taken = tmp_path / "taken"
    taken.write_text("mine")
    line = one_line_error(capsys, "eval", str(ckpt), "--data", str(tmp_path / "d"), "--out", str(taken))
    assert f"{taken}: exists and is not a folder" in line and taken.read_text() == "mine"


def test_fewshot_and_bench_never_overwrite_a_named_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         ckpt: Path) -> None:  # fmt: skip
    """fewshot --out and bench --json/--plot: an existing file is refused (before any work) and kept as it was,
    unless --overwrite (issue 13, item 1: never overwrite what vitkit did not write)."""
    notes = tmp_path / "notes.json"
    notes.write_text("mine\n")
    err = one_line_error(capsys, "fewshot", str(ckpt), "--data", "digits", "--out", str(notes))
    assert str(notes) in err and "--overwrite" in err
    for opt in ("--json", "--plot"):
        err = one_line_error(capsys, "bench", "Ti/16", "--image-size", "32", opt, str(notes))
        assert str(notes) in err and "--overwrite" in err
    assert notes.read_text() == "mine\n"
    err = one_line_error(capsys, "bench", "Ti/16", "--json", str(tmp_path))
    assert "folder" in err


def test_fewshot_overwrite_replaces_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path) -> None:
    out = tmp_path / "fewshot.json"
    out.write_text("old\n")
    code, _, err = run_cli(capsys, "fewshot", str(ckpt), "--data", "digits", "--shots", "1", "--seeds", "1",
                       "--out", str(out), "--overwrite")  # fmt: skip
    assert code == 0, err
    assert json.loads(out.read_text())["checkpoint"] == str(ckpt)
    assert not list(tmp_path.glob(".*"))  # no temp file left beside it


@pytest.mark.parametrize(("field", "value"), [("provenance", [["a"]]), ("provenance", True), ("class_names", [1, 2])])
def test_wrong_typed_metadata_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path,
                                          field: str, value: Any) -> None:  # fmt: skip
    """Found by the fuzzing harness in CI: a non-object provenance crashed the name resolver's metadata merge."""
    bad = Path(_edited(ckpt, tmp_path / "bad"))
    doc = json.loads((bad / "config.json").read_text())
    doc[field] = value
    (bad / "config.json").write_text(json.dumps(doc))
    assert field in one_line_error(capsys, "info", str(bad))


def test_cifar_pickle_naming_an_unknown_encoding_is_one_line(tmp_path: Path) -> None:
    """Found by the fuzzing harness in CI: ``_codecs.encode(..., 'atin1')`` inside a pickle raised LookupError."""
    from vitkit.data.cifar import safe_unpickle
    from vitkit.errors import DataError

    path = tmp_path / "data_batch_1"
    path.write_bytes(
        b"\x80\x02}q\x00X\x04\x00\x00\x00dataq\x01c_codecs\nencode\nq\x02X\x01\x00\x00\x00aX\x05\x00\x00\x00atin1\x86R\x73."
    )
    with pytest.raises(DataError, match="data_batch_1"):
        safe_unpickle(path)


def test_a_config_key_that_breaks_the_line_is_quoted_in_the_error_itself(tmp_path: Path, ckpt: Path) -> None:
    """The library's error, not only the CLI's printing of it, is one line (what the slow checkpoint fuzzer found:
    a config key "\\n" echoed raw)."""
    from vitkit.checkpoints import load_checkpoint
    from vitkit.errors import CheckpointError

    bad = _edited(ckpt, tmp_path / "bad", lambda m: m.update({"\n": None}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert "\n" not in str(e.value) and "unknown ViT config keys: \\x0a" in str(e.value)
