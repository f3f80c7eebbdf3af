"""``vitkit eval`` and ``vitkit fewshot`` as commands, on the bundled digits and on an ImageFolder tree."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import randomize_, run_cli
from vitkit import save_pretrained
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer


def tiny(num_classes: int, size: int) -> VisionTransformer:
    model = create_model(
        "Ti/16", patch_size=size // 2, image_size=size, hidden_size=32, depth=2, num_heads=2, mlp_dim=32,
        num_classes=num_classes,
    )  # fmt: skip
    return randomize_(model).eval()  # type: ignore[return-value]


def direct_predictions(model: VisionTransformer, pre: Preprocess, ds: object) -> np.ndarray:
    with torch.no_grad():
        x = torch.stack([pre.to_tensor(img) for img, _ in ds])  # type: ignore[attr-defined]
        return model(x).argmax(-1).numpy()


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    pre = Preprocess(image_size=8)
    return save_pretrained(tiny(10, 8), root / "model", preprocess=pre, class_names=[str(c) for c in range(10)])


def test_eval_on_digits(capsys: pytest.CaptureFixture[str], tmp_path: Path, digits_ckpt: Path) -> None:
    """--precision fp32 (the checkpoint's own model) gives exactly the metrics of a direct forward, as eval
    always has."""
    out = tmp_path / "ev"
    code, stdout, err = run_cli(
        capsys, "eval", str(digits_ckpt), "--data", "digits", "--out", str(out), "--device", "cpu", "--precision",
        "fp32",
    )  # fmt: skip
    assert code == 0, err
    assert "359 examples" in stdout and "top-5" in stdout
    doc = json.loads((out / "metrics.json").read_text())
    conf = np.array([r[1:] for r in list(csv.reader((out / "confusion.csv").open()))[1:]], dtype=int)
    test = open_dataset("digits", "test")
    from vitkit import load_checkpoint

    loaded = load_checkpoint(digits_ckpt)
    preds = direct_predictions(loaded.model, loaded.meta.preprocess, test)
    assert doc["top1"] == pytest.approx(float((preds == test.labels).mean()))
    assert conf.sum() == 359 and np.trace(conf) == int((preds == test.labels).sum())
    assert (out / "confusion.png").stat().st_size > 1000 and (out / "per_class.csv").is_file()


def test_fewshot_on_digits(capsys: pytest.CaptureFixture[str], tmp_path: Path, digits_ckpt: Path) -> None:
    code, stdout, err = run_cli(
        capsys, "fewshot", str(digits_ckpt), "--data", "digits", "--shots", "1,5", "--seeds", "2", "--l2", "auto",
        "--json", "--out", str(tmp_path / "fs.json"),
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc == json.loads((tmp_path / "fs.json").read_text())
    assert doc["l2_mode"] == "auto" and set(doc["shots"]) == {"1", "5"} and len(doc["shots"]["5"]["per_seed"]) == 2
    assert doc["shots"]["5"]["mean"] > 0.3  # even random ViT features carry digit identity: far above 10% chance
    code, stdout, err = run_cli(capsys, "fewshot", str(digits_ckpt), "--data", "digits", "--shots", "2", "--seeds", "1")
    assert code == 0 and "2^10" in stdout, err


def test_eval_on_an_image_folder_missing_a_class(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The val split lacks class 'b': labels must still index the checkpoint's classes a, b, c; ReaL label
    sets may be keyed by file name."""
    rng = np.random.default_rng(0)
    for split, classes in (("train", "abc"), ("val", "ac")):
        for c in classes:
            (tmp_path / "data" / split / c).mkdir(parents=True)
            for i in range(3):
                img = Image.fromarray(rng.integers(0, 256, size=(12, 12, 3), dtype=np.uint8))
                img.save(tmp_path / "data" / split / c / f"{c}{i}.png")
    pre = Preprocess(image_size=8)
    ckpt = save_pretrained(tiny(3, 8), tmp_path / "model", preprocess=pre, class_names=["a", "b", "c"])
    (tmp_path / "real.csv").write_text("key,labels\na0.png,a b c\nc2.png,\n")
    code, stdout, err = run_cli(
        capsys, "eval", str(ckpt), "--data", str(tmp_path / "data"), "--split", "val", "--out", str(tmp_path / "o"),
        "--real-labels", str(tmp_path / "real.csv"), "--json", "--precision", "fp32",  # compared with the model's own
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(stdout)
    val = open_dataset(tmp_path / "data", "val", classes=["a", "b", "c"])
    from vitkit import load_checkpoint

    preds = direct_predictions(load_checkpoint(ckpt).model, pre, val)
    assert val.labels.tolist() == [0, 0, 0, 2, 2, 2]
    assert doc["top1"] == pytest.approx(float((preds == val.labels).mean()))
    assert doc["per_class"]["b"] == {"accuracy": None, "support": 0}
    assert doc["real_top1"] == 1.0 and doc["real_count"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fewshot", "{ckpt}", "--data", "digits", "--shots", "200"], "has only"),
        (["fewshot", "{ckpt}", "--data", "digits", "--shots", "1,x"], "invalid shots"),
        (["fewshot", "{ckpt}", "--data", "digits", "--l2", "0"], "l2 must be positive"),
        (["eval", "{ckpt}", "--data", "digits", "--real-labels", "nope.json"], "nope.json: no such label file"),
        (["eval", "{ckpt}", "--data", "digits", "--split", "nope"], "no split 'nope'"),
        (["eval", "{ckpt}", "--data", "no/such/dir"], "no/such/dir: no such file or directory"),
        (["eval", "{ckpt}/missing", "--data", "digits"], "missing: no such file or directory"),
        (["eval", "{ckpt}"], "--data"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], digits_ckpt: Path, argv: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, *(a.format(ckpt=digits_ckpt) for a in argv))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
