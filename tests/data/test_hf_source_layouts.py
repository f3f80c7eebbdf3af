"""Which folders ``open_dataset`` reads with ``datasets``: decided from directory entries, stopping at the first
data file (it once walked an image folder's every file with pathlib, most of an ``eval``'s main-thread CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vitkit.data.hf_datasets import is_hf_source


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["train-00000.parquet"], True),  # data files at the top
        (["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"], True),  # the Hub's layout
        (["train/a.arrow", "test/b.arrow"], True),  # split folders, each with data
        (["cat/1.jpg", "dog/2.jpg"], False),  # an ImageFolder
        (["x.parquet", "cat/1.jpg"], False),  # data files beside a class folder of images: the images win
        (["cache-1234.arrow"], False),  # only a `datasets` cache file
        (["README.md", "notes/a.txt"], False),
        (["deep/er/still/a.parquet"], True),
    ],
)
def test_folder_layouts(tmp_path: Path, files: list[str], expected: bool) -> None:
    for f in files:
        touch(tmp_path / f)
    assert is_hf_source(str(tmp_path)) is expected


def test_data_behind_a_folder_link_is_not_followed(tmp_path: Path) -> None:
    touch(tmp_path / "elsewhere" / "a.parquet")
    (tmp_path / "ds").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ds" / "linked")
    assert is_hf_source(str(tmp_path / "ds")) is False
    assert is_hf_source(str(tmp_path / "ds" / "linked")) is True  # named itself, it is read


def test_a_data_file_named_like_a_folder_entry(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").mkdir()  # a folder whose name ends in .parquet is not a data file
    touch(tmp_path / "x.parquet" / "cat.jpg")
    assert is_hf_source(str(tmp_path)) is False
