"""A checkpoint's preprocessing size is bounded and checked against its model when the checkpoint is read
(issue 47, item 7): ``preprocess.image_size`` in a vitkit config.json, ``size`` in an HF
preprocessor_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vitkit
from helpers import run_cli, tiny_checkpoint
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.checkpoints.preprocess import Preprocess

# the sizes: not a multiple of the patch, empty, negative, a MemoryError, minutes per image
BAD_SIZES = [[17, 17], [0, 0], [-4, -4], [40000, 40000], [4000, 4000]]


def vitkit_with(tmp_path: Path, size: object) -> tuple[Path, str]:
    """A tiny vitkit checkpoint (16 px, patches of 8) whose config.json says ``preprocess.image_size: size``."""
    folder = tiny_checkpoint(tmp_path, ["a", "b"])
    doc = json.loads((folder / "config.json").read_text())
    doc["preprocess"]["image_size"] = size
    (folder / "config.json").write_text(json.dumps(doc))
    return folder, "config.json"


def hf_with(tmp_path: Path, size: object) -> tuple[Path, str]:
    """A small HF folder (32 px, patches of 8) whose preprocessor_config.json says ``size: size``."""
    model = vitkit.create_model("Ti/16", image_size=32, patch_size=8, hidden_size=32, depth=1, num_heads=2,
                                mlp_dim=32, num_classes=2)  # fmt: skip
    folder = save_checkpoint(model.eval(), tmp_path / "hf", "hf")
    doc = json.loads((folder / "preprocessor_config.json").read_text())
    doc["size"] = size
    (folder / "preprocessor_config.json").write_text(json.dumps(doc))
    return folder, "preprocessor_config.json"


MAKERS = {"vitkit": vitkit_with, "hf": hf_with, "hf dict": lambda t, s: hf_with(t, {"height": s[0], "width": s[1]})}


@pytest.mark.parametrize("size", BAD_SIZES, ids=str)
@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_a_bad_preprocessing_size_is_one_line_when_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, size: list[int]
) -> None:
    folder, file = MAKERS[fmt](tmp_path, size)
    code, _, err = run_cli(capsys, "info", str(folder))
    assert code == 2 and err.strip().count("\n") == 0, err
    assert file in err and "image" in err and "size" in err, err


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_a_preprocessing_size_up_to_twice_the_model_is_read(tmp_path: Path, fmt: str) -> None:
    """Other sizes the model can take (multiples of its patch, at most twice its side) are kept as written."""
    side = 16 if fmt == "vitkit" else 32
    size = [8, 2 * side]  # MAX_PREPROCESS_SCALE
    folder, _ = MAKERS[fmt](tmp_path, size)
    assert load_checkpoint(folder).meta.preprocess.image_size == tuple(size)


@pytest.mark.parametrize("size", [0, -4, True, 17.5, "224", [16], [16, 16, 16], 1 << 17])
def test_preprocess_refuses_sizes_that_are_no_image_size(size: object) -> None:
    with pytest.raises(ValueError, match="image_size"):
        Preprocess(image_size=size)  # type: ignore[arg-type]
