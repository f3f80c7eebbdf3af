"""The download layer against a real HTTP server on loopback: resume, digests, errors, the cache."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket
import urllib.parse
from pathlib import Path

import pytest
from loopback_http import Server, http_server_fixture, private_caches_fixture  # noqa: F401 (fixtures)

from vitkit.cli import main
from vitkit.hub import cache_dir, download, gs_to_https, read_record
from vitkit.hub.download import DownloadError, cache_path, partial_path, record_path

BODY = os.urandom(3 * (1 << 20) + 12345)  # several 1 MiB chunks, not a multiple of the chunk size
DIGEST = hashlib.sha256(BODY).hexdigest()


def test_download_verifies_records_and_caches(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/w/model.npz"] = BODY
    path = download(http_server.url("/w/model.npz"), cache=tmp_path, progress=False)
    assert path.read_bytes() == BODY
    assert path.is_relative_to(tmp_path)
    rec = read_record(http_server.url("/w/model.npz"), tmp_path)
    assert rec is not None and rec.sha256 == DIGEST and rec.size == len(BODY) and not rec.published_sha256
    again = download(http_server.url("/w/model.npz"), cache=tmp_path, progress=False)
    assert again == path and len(http_server.log) == 1  # served from the cache, no second request


def test_a_download_larger_than_its_cap_is_refused_from_its_length(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/w/big.npz"] = BODY
    url = http_server.url("/w/big.npz")
    with pytest.raises(DownloadError, match=rf"{len(BODY)} bytes, more than the 1048576 bytes .*max_bytes"):
        download(url, cache=tmp_path, progress=False, max_bytes=1 << 20)
    assert not cache_path(url, tmp_path).exists() and not partial_path(url, tmp_path).exists()
    assert download(url, cache=tmp_path, progress=False, max_bytes=len(BODY)).read_bytes() == BODY  # at the cap


def test_a_body_without_a_length_is_read_no_further_than_the_cap(http_server: Server, tmp_path: Path) -> None:
    """A server that never ends its body (no Content-Length): vitkit stops at the cap + 1 and keeps nothing (the
    code before the cap read on for the whole gigabyte the server sends)."""
    http_server.endless.add("/endless.npz")
    url = http_server.url("/endless.npz")
    with pytest.raises(DownloadError, match="more than 1048576 bytes"):
        download(url, cache=tmp_path, progress=False, max_bytes=1 << 20)
    assert not cache_path(url, tmp_path).exists() and not partial_path(url, tmp_path).exists()
    assert http_server.sent["/endless.npz"] < 64 << 20  # what the server got written before the hang-up


def test_a_redirect_from_https_to_http_is_refused(
    http_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS server on loopback (its certificate trusted through SSL_CERT_FILE) redirects to the plain-HTTP one:
    refused, nothing asked of the plain server, nothing kept; https -> https is followed."""
    from loopback_http import self_signed, serve

    tls, cert = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    http_server.files["/w/model.npz"] = BODY
    with serve(tls) as secure:
        secure.files["/w/model.npz"] = BODY
        secure.redirect["/down.npz"] = http_server.url("/w/model.npz")
        secure.redirect["/moved.npz"] = secure.url("/w/model.npz")
        url = secure.url("/down.npz")
        with pytest.raises(DownloadError, match=r"redirected to http:// .*refused"):
            download(url, cache=tmp_path, progress=False)
        assert http_server.log == [] and not cache_path(url, tmp_path).exists()
        assert download(secure.url("/moved.npz"), cache=tmp_path, progress=False).read_bytes() == BODY


def test_cut_connection_resumes_with_range(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/big.npz"] = BODY
    http_server.cut_after["/big.npz"], http_server.cut_times["/big.npz"] = 1_500_000, 2  # cut twice
    path = download(http_server.url("/big.npz"), cache=tmp_path, progress=False, sha256=DIGEST)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DIGEST
    assert [r for _, r in http_server.log] == [None, "bytes=1500000-", "bytes=3000000-"]
    assert read_record(http_server.url("/big.npz"), tmp_path).published_sha256  # type: ignore[union-attr]


def test_cut_download_resumes_in_the_next_call(http_server: Server, tmp_path: Path) -> None:
    url = http_server.url("/big.npz")
    http_server.files["/big.npz"] = BODY
    http_server.cut_after["/big.npz"], http_server.cut_times["/big.npz"] = 1_000_000, 1
    with pytest.raises(DownloadError, match=r"connection cut after 1000000 of \d+ bytes .*run the command again"):
        download(url, cache=tmp_path, progress=False, retries=0)
    assert not cache_path(url, tmp_path).exists()  # nothing the cache would serve
    assert partial_path(url, tmp_path).stat().st_size == 1_000_000
    path = download(url, cache=tmp_path, progress=False)
    assert http_server.log[-1] == ("/big.npz", "bytes=1000000-")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DIGEST
    assert not partial_path(url, tmp_path).exists()


def test_server_without_range_support_restarts(http_server: Server, tmp_path: Path) -> None:
    url = http_server.url("/big.npz")
    http_server.files["/big.npz"] = BODY
    http_server.no_range.add("/big.npz")
    http_server.cut_after["/big.npz"], http_server.cut_times["/big.npz"] = 1_000_000, 1
    path = download(url, cache=tmp_path, progress=False, sha256=DIGEST)  # the 200 answer rewrites from byte 0
    assert path.read_bytes() == BODY and [r for _, r in http_server.log] == [None, "bytes=1000000-"]


def test_stale_partial_longer_than_the_file_is_restarted(http_server: Server, tmp_path: Path) -> None:
    url = http_server.url("/m.npz")
    http_server.files["/m.npz"] = BODY
    part = partial_path(url, tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(os.urandom(len(BODY) + 10))  # left by an older, longer version of the file
    assert download(url, cache=tmp_path, progress=False).read_bytes() == BODY
    assert [r for _, r in http_server.log] == [f"bytes={len(BODY) + 10}-", None]  # 416, then from scratch


def test_wrong_digest_is_refused_and_discarded(http_server: Server, tmp_path: Path) -> None:
    url = http_server.url("/m.npz")
    http_server.files["/m.npz"] = BODY
    http_server.wrong["/m.npz"] = BODY[:-1] + bytes([BODY[-1] ^ 1])  # one bit flipped
    with pytest.raises(DownloadError, match=f"does not match the published {DIGEST}.*discarded"):
        download(url, cache=tmp_path, progress=False, sha256=DIGEST)
    assert not cache_path(url, tmp_path).exists() and not partial_path(url, tmp_path).exists()
    del http_server.wrong["/m.npz"]
    assert download(url, cache=tmp_path, progress=False, sha256=DIGEST).read_bytes() == BODY


def test_a_changed_cached_file_is_refused(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/m.npz"] = BODY
    path = download(http_server.url("/m.npz"), cache=tmp_path, progress=False)
    path.write_bytes(BODY[:100])
    with pytest.raises(DownloadError, match="changed since it was downloaded"):
        download(http_server.url("/m.npz"), cache=tmp_path, progress=False)


def test_not_found(http_server: Server, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match=r"/nope.npz: not found \(HTTP 404\)"):
        download(http_server.url("/nope.npz"), cache=tmp_path, progress=False)
    assert not any(p.is_file() for p in tmp_path.rglob("*") if ".locks" not in p.parts)


def test_unreachable_host_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/m.npz"
    with pytest.raises(DownloadError, match=f"cannot reach 127.0.0.1:{port}.*offline\\? download {url} yourself"):
        download(url, cache=tmp_path, progress=False)


def test_timeout(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/slow.npz"] = BODY
    http_server.stall["/slow.npz"] = 1.0
    with pytest.raises(DownloadError, match=r"timed out after 0.2 s"):
        download(http_server.url("/slow.npz"), cache=tmp_path, progress=False, timeout=0.2, retries=0)


def test_disk_full_before_writing(http_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    http_server.files["/m.npz"] = BODY
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 10, 10))  # type: ignore[attr-defined]
    with pytest.raises(DownloadError, match=r"disk full; free some space.*--cache-dir or VITKIT_HOME"):
        download(http_server.url("/m.npz"), cache=tmp_path, progress=False)


def test_gs_urls_map_to_the_public_endpoint() -> None:
    assert gs_to_https("gs://vit_models/imagenet21k+imagenet2012/ViT-B_16.npz") == (
        "https://storage.googleapis.com/vit_models/imagenet21k%2Bimagenet2012/ViT-B_16.npz"
    )
    assert gs_to_https("https://example.com/a") == "https://example.com/a"


def test_cache_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "vh"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert cache_dir() == tmp_path / "vh"
    monkeypatch.delenv("VITKIT_HOME")
    assert cache_dir() == tmp_path / "xdg" / "vitkit"


def test_download_command(http_server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    http_server.files["/w/model.npz"] = BODY
    assert main(["download", http_server.url("/w/model.npz"), "--cache-dir", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"sha256 {DIGEST} (recorded)" in out and str(tmp_path) in out
    assert main(["download", http_server.url("/missing.npz"), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not found (HTTP 404)" in err


# ---- a cache nobody else can tamper with (issue 25, items 2, 3 and 4) ----------------------------------


def files_outside(root: Path, cache: Path) -> dict[str, bytes]:
    """Every file under ``root`` but not under ``cache``, with its bytes (what a test must find unchanged)."""
    return {
        str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_relative_to(cache)
    }  # fmt: skip


def test_a_link_planted_at_the_partial_path_is_not_written_through(http_server: Server, tmp_path: Path) -> None:
    """A symbolic link where the partial download goes (pointing at a victim file outside the cache): the
    download is refused before any request, the victim is untouched and the cache serves no link."""
    http_server.files["/w/model.npz"] = BODY
    url, cache = http_server.url("/w/model.npz"), tmp_path / "cache"
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own data")
    part = partial_path(url, cache)
    part.parent.mkdir(parents=True)
    part.symlink_to(victim)
    before = files_outside(tmp_path, cache)
    with pytest.raises(DownloadError, match=f"^{re.escape(str(part))}: a symbolic link where vitkit keeps"):
        download(url, cache=cache, progress=False)
    assert files_outside(tmp_path, cache) == before and victim.read_text() == "the victim's own data"
    assert not os.path.lexists(cache_path(url, cache)) and http_server.log == []


def test_links_planted_at_the_record_and_the_cached_file_are_not_followed(http_server: Server, tmp_path: Path) -> None:
    """The record's temporary file (a fixed name before) and the cached file itself: a link there is neither
    written through nor served."""
    http_server.files["/w/model.npz"] = BODY
    url, cache = http_server.url("/w/model.npz"), tmp_path / "cache"
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own data")
    record = record_path(url, cache)
    record.parent.mkdir(parents=True)
    record.with_name(record.name + ".tmp").symlink_to(victim)
    path = download(url, cache=cache, progress=False)
    assert victim.read_text() == "the victim's own data"
    assert path.read_bytes() == BODY and not path.is_symlink() and read_record(url, cache).sha256 == DIGEST  # type: ignore[union-attr]
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(DownloadError, match=f"^{re.escape(str(path))}: a symbolic link where vitkit keeps"):
        download(url, cache=cache, progress=False)
    assert victim.read_text() == "the victim's own data"


@pytest.mark.parametrize("where", ["cache", "downloads", "parent"])
def test_a_cache_other_users_can_write_is_refused(http_server: Server, tmp_path: Path, where: str) -> None:
    """A cache folder (or a folder above it, without the sticky bit) that others can write: they could swap
    the weights or plant links, so vitkit neither downloads into it nor serves from it."""
    http_server.files["/w/model.npz"] = BODY
    url, cache = http_server.url("/w/model.npz"), tmp_path / "shared" / "cache"
    (cache / "downloads").mkdir(parents=True)
    open_to_all = {"cache": cache, "downloads": cache / "downloads", "parent": tmp_path / "shared"}[where]
    open_to_all.chmod(0o777)
    with pytest.raises(DownloadError, match=f"^{re.escape(str(open_to_all))} can be written by others .*chmod go-w"):
        download(url, cache=cache, progress=False)
    assert http_server.log == [] and [p for p in cache.rglob("*") if p.is_file()] == []


def test_different_urls_never_share_an_entry(http_server: Server, tmp_path: Path) -> None:
    """Percent-encoding, characters mapped to "_", schemes, queries, empty segments: each URL its own file."""
    http_server.files["/a%20b"] = b"a space"
    http_server.files["/a_b"] = b"an underscore"
    http_server.files["/x//y"] = b"an empty segment"
    http_server.files["/x/y"] = b"no empty segment"
    paths = {p: download(http_server.url(p), cache=tmp_path, progress=False) for p in http_server.files}
    assert {p: path.read_bytes() for p, path in paths.items()} == http_server.files
    assert len(http_server.log) == 4
    assert download(http_server.url("/a_b"), cache=tmp_path, progress=False).read_bytes() == b"an underscore"
    urls = ["http://h/m.npz", "https://h/m.npz", "http://h/m.npz?v=2", "http://h:8080/m.npz", "http://H/m.npz"]
    entries = [cache_path(u, tmp_path) for u in urls]
    assert len(set(entries)) == len(urls)
    assert entries[0].relative_to(tmp_path).parts[:2] == ("downloads", "h") and entries[0].name == "m.npz"


def test_dot_hosts_are_refused_and_nothing_is_written_outside(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    for url in ("http://../x.npz", "http://./x.npz", "http://.partial/x.npz", "http://user@..:80/x.npz"):
        with pytest.raises(DownloadError, match="is not a host name"):
            download(url, cache=cache, progress=False, retries=0, timeout=1)
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("cache")]


def test_a_cached_file_recorded_for_another_url_is_refused(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/m.npz"] = BODY
    url = http_server.url("/m.npz")
    download(url, cache=tmp_path, progress=False)
    record = record_path(url, tmp_path)
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "url": http_server.url("/other.npz")}))
    with pytest.raises(DownloadError, match=r"cached for another URL \(.*/other.npz\), not .*/m.npz; delete it"):
        download(url, cache=tmp_path, progress=False)


def legacy_entry(url: str, cache: Path, body: bytes, recorded_url: str) -> tuple[Path, Path]:
    """An entry as vitkit wrote it before the digest was in the name: downloads/<netloc>/<path>, and its
    record in downloads/.records/<netloc>/<path>.json."""
    u = urllib.parse.urlsplit(url)
    old = cache / "downloads" / u.netloc.replace(":", "_") / u.path.strip("/")
    old.parent.mkdir(parents=True)
    old.write_bytes(body)
    st = old.stat()
    record = cache / "downloads" / ".records" / old.relative_to(cache / "downloads").with_suffix(".npz.json")
    record.parent.mkdir(parents=True)
    doc = {"url": recorded_url, "sha256": hashlib.sha256(body).hexdigest(), "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "published_sha256": False}  # fmt: skip
    record.write_text(json.dumps(doc))
    return old, record


def test_entries_of_the_earlier_layout_are_moved_when_their_record_names_the_url(
    http_server: Server, tmp_path: Path
) -> None:
    url = http_server.url("/w/model.npz")
    old, old_record = legacy_entry(url, tmp_path, BODY, url)
    path = download(url, cache=tmp_path, progress=False)
    assert http_server.log == []  # not downloaded again
    assert path == cache_path(url, tmp_path) and path.read_bytes() == BODY
    assert not old.exists() and not old_record.exists() and read_record(url, tmp_path).sha256 == DIGEST  # type: ignore[union-attr]


def test_entries_of_the_earlier_layout_for_another_url_are_left_alone(http_server: Server, tmp_path: Path) -> None:
    """The old layout mapped /a%20b and /a_b to one name: the entry recorded for /a_b is not what /a%20b is."""
    http_server.files["/w/a%20b.npz"] = b"the right file"
    url = http_server.url("/w/a%20b.npz")
    old, old_record = legacy_entry(
        http_server.url("/w/a_b.npz"), tmp_path, b"another file", http_server.url("/w/a_b.npz")
    )
    assert download(url, cache=tmp_path, progress=False).read_bytes() == b"the right file"
    assert len(http_server.log) == 1 and old.read_bytes() == b"another file" and old_record.exists()


READ_ONLY_SCRIPT = """
import sys
from vitkit.hub.download import DownloadError, download
for url in sys.argv[2:]:
    try:
        print("ok", download(url, cache=sys.argv[1], progress=False), flush=True)
    except DownloadError as e:
        print("error", e, flush=True)
"""


def simulate_read_only(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a read-only mount answers, at the OS boundary: EROFS for every change under ``root``."""
    import builtins
    import io

    def under(path: object, dir_fd: object = None) -> bool:
        """Whether ``path`` (relative to the folder open as ``dir_fd``, when given) lies under ``root``; a
        descriptor's ``/proc/self/fd/N`` path is followed to its folder, as the kernel does."""
        if not isinstance(path, str | bytes | os.PathLike):
            return False
        name = os.fsdecode(path)
        if isinstance(dir_fd, int):
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        return Path(os.path.realpath(name)).is_relative_to(root.resolve())

    def refuse(path: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))  # type: ignore[arg-type]

    real_os_open, real_io_open = os.open, io.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & writes and under(path, kwargs.get("dir_fd")):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def io_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if set(mode) & set("wax+") and under(file):
            refuse(file)
        return real_io_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(io, "open", io_open)
    monkeypatch.setattr(builtins, "open", io_open)
    for name in ("mkdir", "replace", "rename", "unlink", "rmdir", "utime"):
        real = getattr(os, name)

        def changed(path: object, *args: object, _real: object = real, **kwargs: object) -> object:
            if under(path, kwargs.get("dir_fd", kwargs.get("src_dir_fd"))) or (
                args and under(args[0], kwargs.get("dst_dir_fd"))
            ):
                refuse(path)
            return _real(path, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(os, name, changed)


def run_read_only(
    how: str, cache: Path, urls: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> tuple[list[str], list[str]]:
    """download() each of ``urls`` from ``cache`` made read-only ``how``: the outcomes ("ok PATH" or "error
    MESSAGE") and the warnings about records."""
    if how == "read-only mount":
        import shutil
        import subprocess
        import sys

        if os.getuid() != 0:  # file modes stop everyone but root: the real thing without a mount
            for p in [cache, *cache.rglob("*")]:
                p.chmod(0o555 if p.is_dir() else 0o444)
            try:
                return run_read_only("in process", cache, urls, monkeypatch, caplog)
            finally:
                for p in [cache, *cache.rglob("*")]:
                    p.chmod(0o700 if p.is_dir() else 0o600)
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare to mount a folder read-only")
        mount = f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache}"
        if subprocess.run(["unshare", "--mount", "sh", "-c", mount], capture_output=True).returncode != 0:
            pytest.skip("cannot mount here (no CAP_SYS_ADMIN)")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
        done = subprocess.run(
            ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$0" "$@"', sys.executable, "-c", READ_ONLY_SCRIPT,
             str(cache), *urls],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines(), [line for line in done.stderr.splitlines() if "cannot record" in line]
    if how == "simulated at the OS boundary":
        simulate_read_only(cache, monkeypatch)
    outcomes = []
    for url in urls:
        try:
            outcomes.append(f"ok {download(url, cache=cache, progress=False)}")
        except DownloadError as e:
            outcomes.append(f"error {e}")
    monkeypatch.undo()
    return outcomes, [r.getMessage() for r in caplog.records if "cannot record" in r.getMessage()]


@pytest.mark.parametrize("how", ["simulated at the OS boundary", "read-only mount"])
def test_a_read_only_cache_serves_what_it_holds(
    http_server: Server, tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A copied cache (time stamps changed, so the record must be written again) on a read-only mount: the
    cached file is served with one warning; a file that is not cached is one DownloadError line."""
    http_server.files["/w/model.npz"] = BODY
    http_server.files["/w/other.npz"] = b"not cached"
    url, other, cache = http_server.url("/w/model.npz"), http_server.url("/w/other.npz"), tmp_path / "cache"
    path = download(url, cache=cache, progress=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as `cp -r` leaves it: re-hashed, re-recorded
    caplog.set_level(logging.WARNING, logger="vitkit.hub")
    outcomes, warnings = run_read_only(how, cache, [url, other], monkeypatch, caplog)
    assert outcomes[0] == f"ok {path}"
    assert len(warnings) == 1 and f"{record_path(url, cache)}: cannot record the download" in warnings[0]
    assert outcomes[1].startswith(f"error {cache}: cannot store downloads there (") and "\n" not in outcomes[1]
    assert "Read-only file system" in outcomes[1] or "Permission denied" in outcomes[1]
    assert path.read_bytes() == BODY and len(http_server.log) == 1  # refused before asking the server
