"""``vitkit analyze`` end to end on a small saved checkpoint and real photos."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from helpers import randomize_, run_cli
from vitkit import create_model, save_pretrained
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.data.datasets import open_dataset


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in {
        "token": {"classifier": "token", "pos_embed": "learned"},
        "gap": {"classifier": "gap", "pos_embed": "sincos2d"},
    }.items():
        model = create_model("Ti/16", image_size=(32, 48), depth=2, num_heads=3, num_classes=4, **kw)
        randomize_(model)
        out[name] = save_pretrained(model, root / name, preprocess=Preprocess(image_size=(32, 48)))
    return out


@pytest.mark.parametrize("kind", ["token", "gap"])
def test_analyze_writes_every_figure_and_a_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, sample_jpeg: Path, checkpoints: dict[str, Path], kind: str
) -> None:
    flower = tmp_path / "flower.png"
    from sklearn.datasets import load_sample_image

    Image.fromarray(load_sample_image("flower.jpg")).resize((96, 64)).save(flower)
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys, "analyze", str(checkpoints[kind]), str(sample_jpeg), str(flower), "--out", str(out),
        "--layer", "2", "--head", "3", "--device", "cpu", "--batch-size", "1",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    for key in ("patch_embedding_pca", "position_embedding", "attention_distance", "attention_rollout"):
        png = out / summary[key]["figure"]
        assert png.is_file() and 2_000 < png.stat().st_size < 300_000
    assert (out / "attention_layer2.png").is_file() and summary["attention_maps"]["heads"] == [3]
    dist = summary["attention_distance"]
    assert dist["num_images"] == 2 and len(dist["per_layer_head"]) == 2 and len(dist["per_layer_head"][0]) == 3
    assert all(0 < v < (32**2 + 48**2) ** 0.5 for row in dist["per_layer_head"] for v in row)
    assert summary["grid"] == [2, 3] and summary["patch_stride_pixels"] == 16
    cells = [(r, c) for r in range(2) for c in range(3)]
    uniform = 16 * sum(math.dist(a, b) for a in cells for b in cells) / 36
    assert dist["uniform_attention_reference"] == pytest.approx(uniform, abs=1e-4)
    assert summary["attention_rollout"]["images"] == ["china.jpg", "flower.png"]
    assert len(summary["patch_embedding_pca"]["explained_variance_ratio"]) == 28
    assert "mean attention distance per layer" in stdout


def test_analyze_without_images_and_at_another_resolution(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    code, _, err = run_cli(
        capsys, "analyze", str(checkpoints["token"]), "--out", str(tmp_path), "--image-size", "64x32"
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grid"] == [4, 2] and summary["attention"] == {"skipped": "no images given"}
    assert (tmp_path / "position_embedding_similarity.png").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer", "3"], "--layer 3: the model has 2 layers"),
        (["--layer", "0"], "--layer 0: the model has 2 layers"),
        (["--head", "4"], "--head 4: the model has 3 heads"),
        (["missing.jpg"], "missing.jpg: no such file"),
        (
            ["--device", "cuda:7"] if not __import__("torch").cuda.is_available() else ["--device", "nonsense"],
            "--device",
        ),
    ],
)
def test_analyze_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoints: dict[str, Path], extra: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "analyze", str(checkpoints["token"]), "--out", str(tmp_path), *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_analyze_images_from_a_dataset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Images taken evenly from a dataset split, options before the (empty) image list; grey digits model."""
    model = create_model("Ti/16", patch_size=2, image_size=8, in_channels=1, depth=2, num_heads=3, num_classes=10)
    ckpt = save_pretrained(randomize_(model), tmp_path / "m", preprocess=Preprocess(image_size=8, grayscale=True))  # type: ignore[arg-type]
    code, _, err = run_cli(
        capsys, "analyze", str(ckpt), "--data", "digits", "--num-images", "20", "--max-overlays", "3",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["attention_distance"]["num_images"] == 20 and summary["grid"] == [4, 4]
    first = open_dataset("digits", "test")[0][1]
    assert summary["attention_rollout"]["images"][0] == f"test[0] {first}"
    assert len(summary["attention_rollout"]["images"]) == 3
    assert len(summary["patch_embedding_pca"]["explained_variance_ratio"]) == 4  # 1 x 2 x 2 filters
