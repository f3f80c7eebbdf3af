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


# ---- where compiled code is loaded from (issue 25, items 1 and 5) ---------------------------------------

PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
int vk_add(int a, int b) { return 666; }
"""
is_root = hasattr(os, "getuid") and os.getuid() == 0
OTHER_UID = 4242  # a user that is not this one (the tests that need to make files of another user run as root)


def plant(cache: Path, marker: Path) -> Path:
    """What another local user would do: a library at the name vitkit will load for SOURCE (the name is
    predictable: source, compiler and flags are public), whose constructor runs on load."""
    honest = native.build(SOURCE, "vk_add")  # computes the name (the cache is still private here)
    assert honest is not None and honest.parent == cache / "native"
    c_file = marker.with_suffix(".c")
    c_file.write_text(PLANTED % marker)
    cc = native.compiler()
    assert cc is not None
    subprocess.run([*cc, "-shared", "-fPIC", str(c_file), "-o", str(honest)], check=True)
    return honest


def shared_group(path: Path) -> None:
    """Give ``path`` a group other users are in (a group of the user's own counts as private)."""
    from vitkit.hub.cache import _own_group

    if is_root:
        os.chown(path, -1, OTHER_UID)
    elif _own_group(path.stat().st_gid):
        pytest.skip("needs root to give a folder a group other users are in")


def make_untrusted(how: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "group-writable cache":
        shared_group(cache / "native")
        (cache / "native").chmod(0o770)
    elif how == "world-writable parent without sticky bit":
        cache.chmod(0o777)  # anyone may rename native/ aside and put their own in its place
    elif how == "owned by another user":
        os.chown(cache / "native", OTHER_UID, OTHER_UID)
    elif how == "symlink made by another user":
        link = tmp_path / "shared-link"
        link.symlink_to(cache)
        os.lchown(link, OTHER_UID, OTHER_UID)
        monkeypatch.setenv("VITKIT_HOME", str(link))
    else:
        raise AssertionError(how)


@needs_cc
@pytest.mark.parametrize(
    "how",
    [
        "group-writable cache",
        "world-writable parent without sticky bit",
        pytest.param("owned by another user", marks=pytest.mark.skipif(not is_root, reason="chown needs root")),
        pytest.param("symlink made by another user", marks=pytest.mark.skipif(not is_root, reason="needs root")),
    ],
)
def test_a_cache_others_can_change_is_not_loaded_from(
    how: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library planted in a cache folder another user can change is never loaded: the kernel is compiled in
    the private temporary folder instead, and a warning says so once."""
    marker = tmp_path / "planted-ran"
    plant(cache, marker)
    make_untrusted(how, cache, tmp_path, monkeypatch)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    lib = native.load(SOURCE, "vk_add")
    assert not marker.exists(), "the planted library was loaded"
    assert lib is not None and lib.vk_add(2, 40) == 42
    private = tmp_path / "tmp" / f"vitkit-native-{os.getuid()}"
    assert native.library_dir() == private and (private.stat().st_mode & 0o777) == 0o700
    assert native.load(SOURCE.replace("a + b", "b + a"), "vk_add") is not None  # another kernel: no new warning
    [message] = native_warnings(caplog)
    assert f"not keeping compiled kernels in {cache / 'native'}" in message or "shared-link" in message
    assert f"using {private} instead" in message
    assert not marker.exists()


@needs_cc
def test_safe_caches_are_used_sticky_parents_and_own_links_included(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not over-strict: a world-writable parent with the sticky bit (like /tmp: others cannot rename what is
    ours in it), and a symbolic link of this user's own, keep the cache in use, silently."""
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("VITKIT_HOME", str(shared / "mine"))
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    assert native.library_dir() == shared / "mine" / "native"
    assert (shared / "mine").stat().st_mode & 0o777 == 0o700  # created private (XDG: 0700)
    (tmp_path / "link").symlink_to(shared / "mine")
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "link"))
    lib = native.load(SOURCE, "vk_add")
    assert lib is not None and lib.vk_add(1, 1) == 2
    assert native.library_dir() == tmp_path / "link" / "native"
    assert native_warnings(caplog) == []


def test_untrusted_names_the_path_at_fault(tmp_path: Path) -> None:
    from vitkit.hub.cache import untrusted

    (tmp_path / "a" / "b").mkdir(parents=True)
    assert untrusted(tmp_path / "a" / "b") is None
    (tmp_path / "a").chmod(0o777)
    assert untrusted(tmp_path / "a" / "b") == f"{tmp_path / 'a'} can be written by others (mode 777)"
    (tmp_path / "a").chmod(0o1777)  # sticky: fine for a parent, not for the folder itself
    assert untrusted(tmp_path / "a" / "b") is None
    assert untrusted(tmp_path / "a") == f"{tmp_path / 'a'} can be written by others (mode 1777)"
    (tmp_path / "a" / "b").chmod(0o770)
    shared_group(tmp_path / "a" / "b")
    assert untrusted(tmp_path / "a" / "b") == f"{tmp_path / 'a' / 'b'} can be written by its group (mode 770)"
    (tmp_path / "l").symlink_to("a/b/../b")  # a relative link with "..": resolved as the kernel does
    (tmp_path / "a" / "b").chmod(0o700)
    assert untrusted(tmp_path / "l") is None
    assert untrusted(tmp_path / "nope") == f"{tmp_path / 'nope'}: No such file or directory"


def test_a_folder_writable_by_the_users_own_group_counts_as_private(tmp_path: Path) -> None:
    """User private groups (Debian, Ubuntu, Fedora): each user's primary group is named as the user and has no
    other members, and umask 002 leaves new folders group-writable; refusing those would refuse most caches."""
    from vitkit.hub.cache import _own_group, untrusted

    if not _own_group(os.getgid()):
        pytest.skip("this user's primary group is shared with others")
    (tmp_path / "c").mkdir()
    os.chown(tmp_path / "c", -1, os.getgid())
    (tmp_path / "c").chmod(0o770)
    assert untrusted(tmp_path / "c") is None
    (tmp_path / "c").chmod(0o772)  # others: never
    assert untrusted(tmp_path / "c") == f"{tmp_path / 'c'} can be written by others (mode 772)"


def fail_to_load_in(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """dlopen refuses every library under ``folder``, as on a noexec mount (the loader's own message); the
    paths it was asked for are returned."""
    real, asked = ctypes.CDLL, []

    def cdll(name: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        asked.append(name)
        if Path(name).is_relative_to(folder):
            raise OSError(f"{name}: failed to map segment from shared object")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native.ctypes, "CDLL", cdll)
    return asked


@needs_cc
def test_a_cache_where_libraries_do_not_load_is_reported_once_and_left(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache on a noexec mount (simulated where the OS answers: dlopen fails): the kernel is compiled in the
    private temporary folder and loads; one warning; later kernels in the process go there directly instead of
    being compiled in the cache again (each start recompiled every kernel and ran without them)."""
    asked = fail_to_load_in(cache, monkeypatch)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    caplog.set_level(logging.WARNING, logger="vitkit.native")
    lib = native.load(SOURCE, "vk_add")
    assert lib is not None and lib.vk_add(2, 40) == 42
    private = tmp_path / "tmp" / f"vitkit-native-{os.getuid()}"
    assert Path(asked[-1]).parent == private
    [message] = native_warnings(caplog)
    assert f"compiled in {cache / 'native'} does not load" in message
    assert "failed to map segment" in message and f"using {private} instead" in message
    before = sorted(p.name for p in (cache / "native").iterdir())
    other = native.load(SOURCE.replace("a + b", "a - b"), "vk_sub")
    assert other is not None and other.vk_add(2, 40) == -38
    assert sorted(p.name for p in (cache / "native").iterdir()) == before  # not compiled in the cache again
    assert len(native_warnings(caplog)) == 1


LOAD_IN_NOEXEC = """
import logging, os, sys
from pathlib import Path
from vitkit import native
lib = native.load(sys.argv[1], "vk_add")
print("result", lib.vk_add(20, 22) if lib is not None else None)
print("in the cache", sorted(p.name for p in (Path(os.environ["VITKIT_HOME"]) / "native").iterdir()))
"""


@needs_cc
def test_a_real_noexec_mount_is_left_without_compiling_there(tmp_path: Path) -> None:
    """A real tmpfs mounted noexec (in a mount namespace of its own: nothing outside the test sees it). The
    mount flag is read before compiling, so nothing is compiled there; one warning names the mount."""
    import shutil

    if not is_root or shutil.which("unshare") is None:
        pytest.skip("mounting a tmpfs needs root and unshare")
    mnt, tmp = tmp_path / "noexec", tmp_path / "tmp"
    mnt.mkdir()
    tmp.mkdir(mode=0o700)
    script = tmp_path / "load.py"
    script.write_text(LOAD_IN_NOEXEC)
    env = {
        **os.environ,
        "VITKIT_HOME": str(mnt),
        "TMPDIR": str(tmp),
        "PYTHONPATH": str(Path(native.__file__).parents[1]),
    }
    mount = f"mount -t tmpfs -o noexec,mode=0700,size=16m vitkit-test {mnt}"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", mount], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$0" "$@"', sys.executable, str(script), SOURCE],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "result 42" in done.stdout and "in the cache []" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "vitkit.native" in line]
    assert len(warnings) == 1 and "noexec" in warnings[0] and f"using {tmp}/vitkit-native-0 instead" in warnings[0]
