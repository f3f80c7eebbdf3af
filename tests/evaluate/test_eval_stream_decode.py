"""``eval``, ``fewshot`` and ``knn`` with ``--skip-bad`` open ``--data`` without decoding it first (``predecode=False``,
as predict and embed do): the images are decoded by the job's stream as it reaches them, so before the first batch
reaches the engine only that batch's images have been decoded, and the image that does not decode is left out
and counted: eval's and knn's figures are those of the data set without it (fewshot draws its shots from the
labels before anything is decoded, so a file that fails makes another draw)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import vitkit.images as images
from helpers import randomize_, run_cli
from vitkit import create_model, save_pretrained
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.inference.engine import InferenceEngine

PER_CLASS = 6
BATCH = 4


def _folder(root: Path, broken: bool) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(PER_CLASS):
                pixels = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8) // (1 if c == "a" else 3)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    if broken:
        for split in ("train", "test"):
            (root / split / "a" / "broken.png").write_bytes(b"not an image, but not empty either")
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    model = create_model("Ti/16", patch_size=8, image_size=16, depth=1, num_heads=3, num_classes=2)
    ckpt = save_pretrained(randomize_(model), root / "m", preprocess=Preprocess(image_size=16), class_names=["a", "b"])
    return {"ckpt": ckpt, "bad": _folder(root / "bad", True), "good": _folder(root / "good", False)}


@pytest.fixture
def decodes_before_first_forward(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Per batch through the engine, the images decoded (:func:`vitkit.images.decode_image`, in this process:
    ``--workers 0``) since the one before."""
    decoded: list[int] = [0]
    seen: list[int] = []
    decode, forward = images.decode_image, InferenceEngine.forward

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        decoded[0] += 1
        return decode(*args, **kwargs)

    def first_forward(self: InferenceEngine, *args: Any, **kwargs: Any) -> Any:
        seen.append(decoded[0])
        decoded[0] = 0
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(images, "decode_image", counting_decode)
    monkeypatch.setattr(InferenceEngine, "forward", first_forward)
    return seen


COMMANDS = {
    "eval": ["--split", "test"],
    "fewshot": ["--shots", "1,2", "--seeds", "2"],
    "knn": ["--k", "3"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_skip_bad_decodes_in_the_stream_not_before_it(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    setup: dict[str, Path],
    decodes_before_first_forward: list[int],
    command: str,
) -> None:
    common = [str(setup["ckpt"]), "--workers", "0", "--batch-size", str(BATCH), "--device", "cpu", "--json"]
    out = ["--out", str(tmp_path / "out")]
    code, stdout, err = run_cli(
        capsys, command, *common, *out, "--data", str(setup["bad"]), "--skip-bad", *COMMANDS[command]
    )
    assert code == 0, err
    assert decodes_before_first_forward, "the engine never ran"
    # the first batch's images, not the whole split (13 files) decoded once before the stream
    assert decodes_before_first_forward[0] <= BATCH, decodes_before_first_forward
    assert "broken.png" in err and "left out" in err
    with_bad = json.loads(stdout)
    decodes_before_first_forward.clear()
    code, stdout, err = run_cli(
        capsys, command, *common, "--out", str(tmp_path / "ref"), "--data", str(setup["good"]), *COMMANDS[command]
    )
    assert code == 0, err
    clean = json.loads(stdout)
    if command == "fewshot":  # the shots are drawn from the labels before decoding: another draw, the same shape
        assert with_bad["shots"].keys() == clean["shots"].keys() and with_bad["seeds"] == clean["seeds"]
        return
    keys = {"eval": ["top1", "num_examples", "per_class"], "knn": ["top1", "top5", "num_train", "num_test"]}
    for key in keys[command]:  # the broken file left out: the figures of the data set without it
        assert with_bad[key] == clean[key], (key, with_bad[key], clean[key])
