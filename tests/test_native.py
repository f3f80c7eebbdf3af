"""vitkit.native: C sources compiled once per content into the cache, loaded with ctypes, None when impossible."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitkit import hardware, native

SOURCE = "int vk_add(int a, int b) { return a + b; }\n"
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@needs_cc
def test_a_source_is_compiled_once_into_the_cache_and_runs(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = native.load(SOURCE, "vk_add")
    assert lib is not None and lib.vk_add(2, 40) == 42
    path = native.build(SOURCE, "vk_add")
    assert path is not None and path.parent == cache / "native" and path.name.startswith("vk_add-")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again although cached")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.build(SOURCE, "vk_add") == path


@needs_cc
def test_different_flags_or_source_make_different_libraries() -> None:
    a = native.build(SOURCE, "vk_add")
    b = native.build(SOURCE, "vk_add", ["-DVK_SOMETHING"])
    c = native.build(SOURCE.replace("a + b", "a - b"), "vk_add")
    assert a is not None and b is not None and c is not None and len({a, b, c}) == 3
    assert ctypes.CDLL(str(c)).vk_add(2, 40) == -38


@needs_cc
def test_concurrent_processes_get_one_complete_library(cache: Path) -> None:
    code = (
        "from vitkit import native\n"
        f"lib = native.load({SOURCE!r}, 'vk_race')\n"
        "assert lib is not None and lib.vk_add(1, 2) == 3\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    assert len([p for p in (cache / "native").iterdir() if p.name.startswith("vk_race-")]) == 1


def test_none_without_compiler_missing_cpu_flag_or_broken_source(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.load(SOURCE, "vk_add", needs=["no_such_cpu_flag"]) is None
    if native.compiler() is not None:
        assert native.load("this is not C", "vk_broken") is None
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2"})
    assert native.load(SOURCE, "vk_add", needs=["avx512_bf16"]) is None
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert native.load(SOURCE, "vk_add") is None


def test_an_unwritable_cache_falls_back_to_a_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VITKIT_HOME", str(blocker))  # cache_dir()/native cannot be created under a file
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    where = native.library_dir()
    assert where is not None and where.parent == tmp_path / "tmp" and where.name.startswith("vitkit-native-")
    assert blocker.read_text() == "not a directory"


def test_a_temporary_directory_others_can_write_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared temporary directory: a vitkit-native-<uid> folder another user could write (or have planted a
    library in) is refused rather than loaded from."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VITKIT_HOME", str(blocker))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    planted = tmp_path / "tmp" / f"vitkit-native-{os.getuid()}"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    assert native.library_dir() is None
    assert native.load(SOURCE, "vk_add") is None
    planted.chmod(0o700)
    assert native.library_dir() == planted


def test_a_hanging_compiler_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$CC that takes too long: load() gives up after the timeout, returns None and caches nothing (waiting,
    it would have renamed the junk this one writes into the cache)."""
    hang = tmp_path / "hangcc"
    hang.write_text('#!/bin/sh\nsleep 3\nfor a; do out="$a"; done\necho junk > "$out"\n')  # late, and no library
    hang.chmod(0o755)
    monkeypatch.setenv("CC", str(hang))
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 0.5)
    assert native.compiler() == [str(hang)]
    assert native.load(SOURCE, "vk_hang") is None
    assert not any((tmp_path / "home" / "native").iterdir())


@needs_cc
def test_cc_with_arguments_is_run_as_a_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$CC such as "ccache gcc" is a command with arguments (the build convention), not one program name: the
    wrapper is the one that runs, with the real compiler as its first argument."""
    real = native.compiler()
    assert real is not None
    log = tmp_path / "ran"
    wrapper = tmp_path / "wrapcc"
    wrapper.write_text(f'#!/bin/sh\necho "$1" > {log}\nexec "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", f"{wrapper} {real[0]}")
    assert native.compiler() == [str(wrapper), real[0]]
    lib = native.load(SOURCE, "vk_add")
    assert lib is not None and lib.vk_add(1, 2) == 3
    assert log.read_text().strip() == real[0]


@needs_cc
def test_a_damaged_cached_library_is_built_again(cache: Path) -> None:
    """A cached library cut short (a full disk, a copy of the cache) does not load: it is vitkit's own file, so
    it is replaced by a fresh build instead of leaving the caller on its fallback for good."""
    path = native.build(SOURCE, "vk_add")
    assert path is not None
    path.write_bytes(path.read_bytes()[:100])
    lib = native.load(SOURCE, "vk_add")
    assert lib is not None and lib.vk_add(20, 22) == 42
    assert path.stat().st_size > 100
