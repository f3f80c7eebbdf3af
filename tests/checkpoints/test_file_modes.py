"""Every file of a checkpoint vitkit writes gets one mode, that of a new file under the user's umask
(0666 & ~umask), whichever library wrote it: safetensors' save_file alone makes 0600 files, so a config was
readable where its weights were not (issue 25, item 18)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import vitkit
from helpers import FIXTURES, file_modes, run_cli, umask_modes
from vitkit import fileio
from vitkit.checkpoints import save_checkpoint

CKPT = FIXTURES / "official_vit_tiny.npz"
# every format `vitkit convert` writes (timm's .pth and hub folder through the library below)
TARGETS = {
    "vitkit": "v", "hf": "hf", "timm": "t.safetensors", "official": "o.npz", "big_vision": "bv.npz",
}  # fmt: skip


@pytest.fixture(params=[0o022, 0o027, 0o002], ids=lambda m: f"umask{m:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_umask_is_read_without_changing_it(umask: int) -> None:
    assert fileio.umask() == umask and fileio.file_mode() == 0o666 & ~umask
    assert os.umask(umask) == umask  # still what the test set


def test_every_format_convert_and_save_write_writes_the_umask_mode(
    umask: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for fmt, name in TARGETS.items():
        code, _, err = run_cli(capsys, "convert", str(CKPT), str(tmp_path / name), "--to", fmt)
        assert code == 0, err
        assert file_modes(tmp_path / name) == umask_modes(tmp_path / name, umask), fmt
    model = vitkit.create_model("Ti/16", image_size=32, patch_size=16, depth=1, num_classes=2, gelu="exact")
    for name in ("t.pth", "tf"):  # timm's other two layouts, through the library (a .pth takes timm's defaults)
        save_checkpoint(model, tmp_path / name, "timm")
        assert file_modes(tmp_path / name) == umask_modes(tmp_path / name, umask), name
    vitkit.save_pretrained(model, tmp_path / "v", overwrite=True)  # a replaced folder too
    assert file_modes(tmp_path / "v") == umask_modes(tmp_path / "v", umask)


def test_onnx_export_gets_the_umask_mode(umask: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxscript")
    code, _, err = run_cli(capsys, "export", str(CKPT), str(tmp_path / "m.onnx"))
    assert code == 0, err
    assert file_modes(tmp_path / "m.onnx") == umask_modes(tmp_path / "m.onnx", umask)
