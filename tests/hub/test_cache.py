"""vitkit's private cache folders: one that another process creates in the instant between the check and the
``mkdir`` is used only if no one else can change it (issue 32, section 4)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vitkit.hub import cache


def test_a_folder_created_meanwhile_by_another_process_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "features" / "abc"
    real_mkdir = os.mkdir

    def racing_mkdir(path: os.PathLike[str] | str, mode: int = 0o777) -> None:
        real_mkdir(path, 0o700)  # what another process made first: world-writable
        os.chmod(path, 0o777)
        raise FileExistsError(17, "File exists", str(path))

    monkeypatch.setattr(cache.os, "mkdir", racing_mkdir)
    with pytest.raises(PermissionError, match="created meanwhile by another process"):
        cache.private_dirs(target)
    monkeypatch.setattr(cache.os, "mkdir", real_mkdir)
    cache.private_dirs(tmp_path / "fine" / "here")  # no race: created 0700
    assert (tmp_path / "fine" / "here").stat().st_mode & 0o777 == 0o700
