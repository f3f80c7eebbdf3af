"""Hugging Face datasets on disk, written by the datasets library itself, read through open_dataset."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import FIXTURES, SRC, run_cli
from vitkit.data.datasets import open_dataset
from vitkit.data.image_dataset import MissingSplitError
from vitkit.errors import DataError

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-datasets"))


def png(value: int, size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def pets(n: int = 6, names: tuple[str, ...] = ("cat", "dog")) -> datasets.Dataset:
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(names))})
    rows = {"image": [{"bytes": png(i * 30), "path": None} for i in range(n)], "label": [i % 2 for i in range(n)]}
    return datasets.Dataset.from_dict(rows, features=feats)


def test_save_to_disk_dataset_dict(tmp_path: Path) -> None:
    ds = pets()
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(2))}).save_to_disk(tmp_path / "saved")
    train = open_dataset(tmp_path / "saved", "train")
    assert train.classes == ["cat", "dog"] and len(train) == 6 and train.labels.tolist() == [0, 1, 0, 1, 0, 1]
    img, label = train[3]
    assert img.mode == "RGB" and img.size == (32, 32) and np.asarray(img)[0, 0, 0] == 90 and label == 1
    val = open_dataset(tmp_path / "saved", "val")  # 'val' finds 'validation'
    assert len(val) == 2
    with pytest.raises(MissingSplitError, match="no split 'test' \\(splits: train, validation\\)"):
        open_dataset(tmp_path / "saved", "test")


def test_parquet_and_arrow_files(tmp_path: Path) -> None:
    ds = pets()
    ds.to_parquet(tmp_path / "pets.parquet")
    assert open_dataset(tmp_path / "pets.parquet").labels.tolist() == [0, 1, 0, 1, 0, 1]
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    ds.to_parquet(folder / "train-00000-of-00001.parquet")
    ds.select(range(3)).to_parquet(folder / "test-00000-of-00001.parquet")
    test = open_dataset(tmp_path / "repo", "test")
    assert len(test) == 3 and test.classes == ["cat", "dog"]
    ds.save_to_disk(tmp_path / "single")
    arrow = next((tmp_path / "single").glob("*.arrow"))
    shutil.copyfile(arrow, tmp_path / "pets.arrow")
    assert len(open_dataset(tmp_path / "pets.arrow")) == 6
    assert len(open_dataset(tmp_path / "single")) == 6  # a saved Dataset is the train split
    with pytest.raises(MissingSplitError, match="serves split 'train' only"):
        open_dataset(tmp_path / "single", "test")


def test_columns_by_type_name_or_option(tmp_path: Path) -> None:
    feats = datasets.Features({
        "img": datasets.Image(),
        "fine_label": datasets.ClassLabel(names=["a", "b", "c"]),
        "coarse_label": datasets.ClassLabel(names=["x", "y"]),
    })  # fmt: skip
    rows = {"img": [{"bytes": png(i), "path": None} for i in range(4)], "fine_label": [2, 0, 1, 2],
            "coarse_label": [1, 0, 0, 1]}  # fmt: skip
    datasets.Dataset.from_dict(rows, features=feats).to_parquet(tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"several label columns \(fine_label, coarse_label\); choose one"):
        open_dataset(tmp_path / "c.parquet")
    fine = open_dataset(f"{tmp_path / 'c.parquet'}?label=fine_label")
    assert fine.classes == ["a", "b", "c"] and fine.labels.tolist() == [2, 0, 1, 2]
    coarse = open_dataset(tmp_path / "c.parquet", label_column="coarse_label")
    assert coarse.classes == ["x", "y"]
    with pytest.raises(DataError, match="no column 'nope'"):
        open_dataset(tmp_path / "c.parquet", label_column="nope")
    # string labels, plain binary image column found by its name
    plain = datasets.Dataset.from_dict({"image": [png(1), png(2), png(3)], "label": ["owl", "bat", "owl"]})
    plain.to_parquet(tmp_path / "s.parquet")
    s = open_dataset(tmp_path / "s.parquet")
    assert s.classes == ["bat", "owl"] and s.labels.tolist() == [1, 0, 1] and s[0][0].size == (32, 32)


def test_bad_rows_name_their_index(tmp_path: Path) -> None:
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    rows = {"image": [{"bytes": png(0), "path": None}, {"bytes": b"not a png", "path": None},
                      {"bytes": png(9), "path": None}], "label": [0, 1, None]}  # fmt: skip
    datasets.Dataset.from_dict(rows, features=feats).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet \(train\) row 2: no label in column 'label'"):
        open_dataset(tmp_path / "bad.parquet")
    ds = open_dataset(tmp_path / "bad.parquet", skip_bad=True)
    assert len(ds) == 1 and [s.item.rsplit(" ", 1)[-1] for s in ds.skipped] == ["2", "1"]
    rows["label"] = [0, 1, 0]
    datasets.Dataset.from_dict(rows, features=feats).to_parquet(tmp_path / "bad2.parquet")
    ds = open_dataset(tmp_path / "bad2.parquet")
    with pytest.raises(DataError, match=r"bad2.parquet \(train\) row 1: unreadable image"):
        ds[1]


def test_hub_dataset_id_from_the_local_cache_offline(tmp_path: Path) -> None:
    """A dataset repository in huggingface_hub's cache (as datasets downloads it), read in a fresh process
    with HF_HUB_OFFLINE=1; an id that is not cached says so."""
    snap = tmp_path / "hub" / "datasets--acme--pets" / "snapshots" / ("e" * 40)
    (snap / "data").mkdir(parents=True)
    pets().to_parquet(snap / "data" / "train-00000-of-00001.parquet")
    pets(4).to_parquet(snap / "data" / "test-00000-of-00001.parquet")
    (tmp_path / "hub" / "datasets--acme--pets" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--acme--pets" / "refs" / "main").write_text("e" * 40)
    code = (
        "from vitkit.data.datasets import open_dataset\n"
        "ds = open_dataset('acme/pets', 'test'); print(len(ds), ds.classes, ds.labels.tolist())\n"
        "try:\n    open_dataset('acme/absent')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "ds-cache")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "4 ['cat', 'dog'] [0, 1, 0, 1]"
    assert lines[1].startswith("DataError acme/absent: no such file or directory, and not a Hub dataset in the local")


def test_eval_command_reads_a_saved_dataset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=5)})
    rows = {"image": [{"bytes": png(i * 40), "path": None} for i in range(5)], "label": [0, 1, 2, 3, 4]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows, features=feats)}).save_to_disk(tmp_path / "d")
    ckpt = str(FIXTURES / "official_vit_tiny.npz")
    code, out, err = run_cli(capsys, "eval", ckpt, "--data", str(tmp_path / "d"), "--out", str(tmp_path / "e"))
    assert code == 0, err
    assert f"on {tmp_path / 'd'} [test]: 5 examples" in out


def test_image_cells_go_through_the_decoders_bounds(tmp_path: Path) -> None:
    """A 144-megapixel PNG of a few KB (the decoder refuses more than 89 MP), a JPEG scan bomb's bytes and a cell
    whose ``path`` names a file outside the dataset's folder: each one line naming the row, counted with
    ``skip_bad``; a cell's path inside the dataset's folder still reads."""
    from vitkit.images import ImageTooLarge

    buf = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buf, "PNG")
    secret = tmp_path / "secret.png"
    secret.write_bytes(png(7))
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "inside.png").write_bytes(png(8))
    feats = datasets.Features({"image": datasets.Image(decode=False), "label": datasets.ClassLabel(names=["a"])})
    cells = [{"bytes": buf.getvalue(), "path": None}, {"bytes": None, "path": str(secret)},
             {"bytes": None, "path": str(folder / "inside.png")}]  # fmt: skip
    datasets.Dataset.from_dict({"image": cells, "label": [0, 0, 0]}, features=feats).to_parquet(folder / "d.parquet")
    ds = open_dataset(folder / "d.parquet")
    with pytest.raises(ImageTooLarge, match=r"row 0: image of 12000x12000 = 144000000 pixels exceeds"):
        ds[0]
    with pytest.raises(DataError, match=r"row 1: its image is a file outside the dataset's folder"):
        ds[1]
    assert np.asarray(ds[2][0])[0, 0, 0] == 8
    skipped = open_dataset(folder / "d.parquet", skip_bad=True)
    assert len(skipped) == 1 and [s.item.rsplit(" ", 1)[-1] for s in skipped.skipped] == ["0", "1"]


@pytest.mark.parametrize("version", ["2.20.0", "3.6.0", "4.0.0", datasets.__version__])
def test_load_dataset_never_runs_a_loading_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """Every ``load_dataset`` call says ``trust_remote_code=False`` where the installed datasets can run a
    dataset's loading script (before 4.0), and leaves the argument out from 4.0 (no scripts, nor the option);
    the installed version takes what it is given (issue 32)."""
    ds = pets()
    ds.to_parquet(tmp_path / "pets.parquet")
    (tmp_path / "repo").mkdir()
    ds.to_parquet(tmp_path / "repo" / "train.parquet")
    calls: list[dict[str, object]] = []
    real = datasets.load_dataset

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    monkeypatch.setattr(datasets, "__version__", version)
    assert len(open_dataset(tmp_path / "pets.parquet")) == 6
    assert len(open_dataset(tmp_path / "repo")) == 6
    scripts = int(version.split(".")[0]) < 4
    assert len(calls) == 2
    assert all(("trust_remote_code" in k) == scripts and k.get("trust_remote_code", False) is False for k in calls)
