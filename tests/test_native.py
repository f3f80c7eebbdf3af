"""vitkit.native: C sources compiled once per content into the cache, loaded with ctypes, None when impossible."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import time
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

    monkeypatch.setattr(subprocess, "Popen", no_compiler)
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


def fake_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    cc = tmp_path / "fakecc"
    cc.write_text("#!/bin/sh\n" + body)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    return cc


def native_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vitkit.native" and r.levelno == logging.WARNING]


def test_a_failed_compilation_is_reported_once_per_source_with_the_compilers_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that falls back says why: the command and the first lines of what the compiler wrote to stderr
    (not the whole of a long error cascade), once per source in a process, not once per call."""
    cc = fake_compiler(
        tmp_path, monkeypatch, 'for i in $(seq 1 40); do echo "vk.c:$i: error: no good $i" >&2; done\nexit 1\n'
    )
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    assert native.load(SOURCE, "vk_fails") is None
    assert native.load(SOURCE, "vk_fails") is None  # the same source again: tried again, not reported again
    [message] = native_warnings(caplog)
    assert "vk_fails" in message and "exit status 1" in message and str(cc) in message and "-fPIC" in message
    assert "vk.c:1: error: no good 1" in message and f"vk.c:{native.STDERR_LINES}: error" in message
    assert (
        f"vk.c:{native.STDERR_LINES + 1}: error" not in message
        and f"({40 - native.STDERR_LINES} more lines)" in message
    )
    assert native.load(SOURCE.replace("a + b", "a * b"), "vk_fails") is None  # another source: its own report
    assert len(native_warnings(caplog)) == 2


@needs_cc
def test_a_real_compiler_error_is_reported_and_a_good_build_is_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="vitkit.native")
    assert native.load(SOURCE, "vk_add") is not None
    assert [r for r in caplog.records if r.name == "vitkit.native"] == []
    assert native.load("int vk_broken(void) { return undeclared_name; }\n", "vk_broken") is None
    [message] = native_warnings(caplog)
    assert "vk_broken" in message and "undeclared_name" in message


def test_a_hanging_compiler_is_killed_with_the_processes_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """cc runs cc1 and as as its children: on a timeout the whole process group goes, not the driver alone
    (which would leave its children compiling, or hung, after vitkit has given up)."""
    pidfile = tmp_path / "child.pid"
    fake_compiler(tmp_path, monkeypatch, f"sleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    started = time.monotonic()
    try:
        assert native.load(SOURCE, "vk_hang_children") is None
        assert time.monotonic() - started < 30  # gave up at the timeout, did not wait for the children
        child = int(pidfile.read_text())
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the compiler's child outlived the timeout"
    finally:
        if pidfile.is_file() and alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)
    [message] = native_warnings(caplog)
    assert "vk_hang_children" in message and "gave up after 1 s" in message


def alive(pid: int) -> bool:
    """Running (a killed orphan may stay a zombie until init gets to it: that is not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@needs_cc
@pytest.mark.skipif(not {"avx512f", "avx512_bf16"} <= hardware.cpu_flags(), reason="needs AVX-512 BF16")
def test_a_kernel_source_carries_the_shared_header_and_its_own_line_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flags = ("-mavx512f", "-mavx512bw", "-mavx512bf16")
    kernel = tmp_path / "k.c"
    # the shared helpers are usable: exp_neg(0) = 1 and narrow/widen round-trip it through bf16
    kernel.write_text(
        "float vk_one(void) {\n    __m512 e = widen(narrow(exp_neg(_mm512_setzero_ps())));\n"
        "    return _mm512_reduce_add_ps(e) / 16;\n}\n"
    )
    lib = native.load(native.kernel_source(kernel), "vk_one", flags)
    assert lib is not None
    lib.vk_one.restype = ctypes.c_float
    assert lib.vk_one() == 1.0
    # a compiler error is reported at the kernel's own file and line, not the concatenated text's
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    kernel.write_text("int vk_bad(void) {\n    return undeclared_name;\n}\n")
    assert native.load(native.kernel_source(kernel), "vk_bad", flags) is None
    [message] = native_warnings(caplog)
    assert "k.c:2" in message
