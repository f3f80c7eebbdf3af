"""A ``--data`` that is shaped like a local path and does not exist is one line, and nothing asks the Hub for it
(issue 47, item 13): ``photos/holiday`` where ``photos/`` is a local folder, or a name ending in a dataset
file's suffix."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from helpers import run_cli, tiny_checkpoint
from vitkit.data.datasets import open_dataset
from vitkit.errors import DataError


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every attempt to open a network connection in this process, recorded and refused."""
    tried: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        tried.append(address)
        raise OSError("network use in a test")

    def no_lookup(host: object, *args: object, **kwargs: object) -> list[object]:
        tried.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "name lookup in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)  # a name looked up is a request on its way
    return tried


def hub_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls into the datasets library's and huggingface_hub's Hub lookups, recorded."""
    calls: list[str] = []
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    def record(name: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls.append(f"{name}{args}")
            raise OSError("no Hub in this test")

        return call

    monkeypatch.setattr(datasets, "load_dataset", record("load_dataset"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", record("snapshot_download"))
    return calls


@pytest.mark.parametrize("name", ["photos/holiday", "holiday/train.parquet", "acme/pets.npz"])
def test_a_missing_path_shaped_data_is_refused_without_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connections: list[object], name: str
) -> None:
    calls = hub_calls(monkeypatch)
    (tmp_path / "photos").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"^{name}: no such file or directory"):
        open_dataset(name)
    assert calls == [] and connections == []


def test_predict_with_a_missing_data_folder_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connections: list[object]
) -> None:
    calls = hub_calls(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path, ["a", "b"])
    (tmp_path / "photos").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "predict", "-c", str(ckpt), "--data", "photos/holiday", "--workers", "0")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "photos/holiday: no such file or directory" in err
    assert calls == [] and connections == []


def test_an_id_shaped_name_still_goes_to_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``acme/pets`` with no ``acme`` here is still a Hub id (read from the local cache)."""
    calls = hub_calls(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="not a Hub dataset in the local"):
        open_dataset("acme/pets")
    assert calls and calls[0].startswith("load_dataset")


def test_a_name_in_no_local_cache_sends_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connections: list[object]
) -> None:
    """``photos/holiday`` with no ``photos/`` here is spelled like a Hub id, so nothing tells it from one; it is
    looked up in the local caches only (the real ``datasets`` and huggingface_hub, empty caches): one line, and
    not one connection is attempted (before, ``datasets`` asked the Hub's endpoint)."""
    pytest.importorskip("datasets")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.chdir(tmp_path)
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match=r"^photos/holiday: no such file or directory, and not a Hub dataset in the"):
        open_dataset("photos/holiday")
    assert connections == []
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False  # restored
