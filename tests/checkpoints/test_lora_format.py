"""LoRA adapter folders as a checkpoint format: a folder whose base is an adapter folder (itself, or a loop of
two) is one line, never followed (issue 32: a self-based folder was a RecursionError of 3,004 lines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vitkit
from helpers import randomize_, run_cli
from vitkit.checkpoints.loaded import state_digest
from vitkit.checkpoints.lora_format import save
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import CheckpointError
from vitkit.models import create_model
from vitkit.models.lora import LoraSpec, add_lora


def _adapters(tmp_path: Path, name: str) -> Path:
    base = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=1, num_heads=2,
                                   mlp_dim=32, num_classes=3)).eval()  # fmt: skip
    base_dir = vitkit.save_pretrained(base, tmp_path / f"{name}-base", preprocess=Preprocess(image_size=16))
    digest = state_digest(vitkit.load_checkpoint(base_dir).model.state_dict())
    spec = LoraSpec(rank=2)
    add_lora(base, spec)
    return save(base, tmp_path / name, base=str(base_dir), base_digest=digest, spec=spec)


def _rebase(folder: Path, base: Path) -> None:
    cfg = folder / "config.json"
    doc = json.loads(cfg.read_text())
    doc["base"]["checkpoint"] = str(base)
    cfg.write_text(json.dumps(doc))


def test_an_adapter_folder_loads_over_its_base(tmp_path: Path) -> None:
    assert vitkit.load_checkpoint(_adapters(tmp_path, "a")).model.cfg.num_classes == 3


def test_a_base_that_is_an_adapter_folder_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b = _adapters(tmp_path, "a"), _adapters(tmp_path, "b")
    _rebase(a, a)  # itself
    with pytest.raises(CheckpointError, match="is itself a LoRA adapter folder"):
        vitkit.load_checkpoint(a)
    _rebase(a, b)  # a loop of two
    _rebase(b, a)
    code, _, err = run_cli(capsys, "info", str(a))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is itself a LoRA adapter folder" in lines[0], err
