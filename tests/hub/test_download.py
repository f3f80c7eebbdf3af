"""The download layer against a real HTTP server on loopback: resume, digests, errors, the cache."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
from loopback_http import Server, http_server_fixture, private_caches_fixture  # noqa: F401 (fixtures)

from vitkit.cli import main
from vitkit.hub import cache_dir, download, gs_to_https, read_record
from vitkit.hub.download import DownloadError, cache_path, partial_path

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
