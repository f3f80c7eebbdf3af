"""Recursive glob patterns through symbolic links (issue 47, item 12): each file once, loops cut, and the work
bounded by the folders there are (counted as ``os.scandir`` calls)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vitkit.data.stream import list_inputs


class TooMuchWork(Exception):
    pass


@pytest.fixture
def scandir_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``os.scandir`` call (glob's too), refused past 200: a loop shows as an error, not as a hang."""
    calls: list[str] = []
    real = os.scandir

    def counted(path: object = ".") -> object:
        calls.append(os.fspath(path))  # type: ignore[arg-type]
        if len(calls) > 200:
            raise TooMuchWork(f"{len(calls)} folder listings")
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", counted)
    return calls


def photos(tmp_path: Path, loops: int) -> Path:
    root = tmp_path / "photos"
    (root / "sub" / "deeper").mkdir(parents=True)
    for rel in ("a.jpg", "sub/b.jpg", "sub/deeper/c.jpg", ".hidden.jpg"):
        (root / rel).write_bytes(b"x")
    for i in range(loops):
        (root / ("sub" if i else ".") / f"loop{i}").symlink_to("." if i == 0 else "..")
    return root


@pytest.mark.parametrize("loops", [1, 2])
def test_a_recursive_glob_lists_each_file_once_through_looping_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scandir_calls: list[str], loops: int
) -> None:
    photos(tmp_path, loops)
    monkeypatch.chdir(tmp_path)
    assert list_inputs(["photos/**/*.jpg"]) == ["photos/a.jpg", "photos/sub/b.jpg", "photos/sub/deeper/c.jpg"]
    assert len(scandir_calls) <= 10  # the three folders, once each (a few more allowed)


def test_a_link_to_a_folder_elsewhere_is_followed_once(tmp_path: Path, scandir_calls: list[str]) -> None:
    root = photos(tmp_path, 0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "d.jpg").write_bytes(b"x")
    (root / "more").symlink_to(other)
    (root / "sub" / "again").symlink_to(other)
    (other / "back").symlink_to(root)
    found = list_inputs([f"{root}/**/*.jpg"])
    assert sorted(Path(p).name for p in found) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]
    assert f"{root}/sub/b.jpg" in found  # a folder reachable without a link keeps its own path


def test_glob_rules_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    photos(tmp_path, 0)
    (tmp_path / "photos" / ".private").mkdir()
    (tmp_path / "photos" / ".private" / "e.jpg").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert list_inputs(["photos/**/c.jpg"]) == ["photos/sub/deeper/c.jpg"]
    assert list_inputs(["**/b.jpg"]) == ["photos/sub/b.jpg"]
    assert list_inputs(["photos/**/.*.jpg"]) == ["photos/.hidden.jpg"]
    assert list_inputs(["photos/.private/**/*.jpg"]) == ["photos/.private/e.jpg"]
    assert list_inputs(["photos/s?b/**"]) == ["photos/sub/b.jpg", "photos/sub/deeper/c.jpg"]
    assert list_inputs(["photos/*.jpg"]) == ["photos/a.jpg"]
