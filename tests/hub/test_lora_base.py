"""A LoRA adapter folder's base checkpoint, against a real HTTP server on loopback (issue 32): a remote base that
only the folder names is never fetched (the folder's author would choose what vitkit downloads); one that the
user names (``lora_base=``) or already downloaded is; and the folder's size fields are bounded before anything
is allocated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from loopback_http import (  # noqa: F401 (fixtures)
    Server,
    http_server_fixture,
    private_caches_fixture,
    put_in_hub_cache,
)

import vitkit
from helpers import FIXTURES, run_cli
from vitkit.checkpoints import save_checkpoint
from vitkit.checkpoints.loaded import state_digest
from vitkit.checkpoints.lora_format import RemoteBase, save
from vitkit.errors import CheckpointError
from vitkit.hub import download
from vitkit.models.lora import LoraSpec, add_lora

pytest.importorskip("peft")

NPZ = FIXTURES / "official_vit_tiny.npz"


def _adapters(tmp_path: Path, base: str) -> Path:
    """An adapter folder trained (here: drawn) on the fixture .npz, its config naming ``base``."""
    model = vitkit.load_checkpoint(NPZ).model
    digest = state_digest(model.state_dict())
    add_lora(model, LoraSpec(rank=2), seed=0)
    return save(model, tmp_path / "adapters", base=base, base_digest=digest, spec=LoraSpec(rank=2))


def _edit(folder: Path, change: Any) -> None:
    cfg = folder / "config.json"
    doc = json.loads(cfg.read_text())
    change(doc)
    cfg.write_text(json.dumps(doc))


def test_a_remote_base_named_only_by_the_folder_is_not_fetched(
    http_server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    http_server.files["/base.npz"] = NPZ.read_bytes()
    url = http_server.url("/base.npz")
    folder = _adapters(tmp_path, url)
    with pytest.raises(RemoteBase, match=r"is remote and named by the adapter folder, not by you.*vitkit download"):
        vitkit.load_checkpoint(folder)
    code, _, err = run_cli(capsys, "info", str(folder))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not fetched" in err, err
    assert http_server.log == []  # not one request
    named = vitkit.load_checkpoint(folder, lora_base=url)  # the user names it: fetched, digest checked
    assert named.model.cfg.num_classes == 5 and len(http_server.log) == 1
    assert vitkit.load_checkpoint(folder).model.cfg.num_classes == 5  # in the cache now: the user fetched it
    assert len(http_server.log) == 1


def test_a_base_the_user_downloaded_is_used_as_named(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/b.npz"] = NPZ.read_bytes()
    url = http_server.url("/b.npz")
    folder = _adapters(tmp_path, url)
    download(url, progress=False)  # vitkit download URL
    assert vitkit.load_checkpoint(folder).model.cfg.num_classes == 5
    assert len(http_server.log) == 1


def test_a_hub_id_named_only_by_the_folder_is_not_fetched(tmp_path: Path) -> None:
    folder = _adapters(tmp_path, "someone/planted-base")
    with pytest.raises(RemoteBase, match="someone/planted-base is remote"):
        vitkit.load_checkpoint(folder)


def test_a_hub_base_is_read_only_when_its_weights_are_cached(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder's Hub base with only its config.json in huggingface_hub's cache (a listing fetched it, say): loading
    would download the weights the folder chose, so it is refused as an uncached base is; with the weights cached
    too (the user ran ``vitkit download``) it is read, from the cache (the Hub is offline here)."""
    base = save_checkpoint(vitkit.load_checkpoint(NPZ).model, tmp_path / "base", "vitkit")
    folder = _adapters(tmp_path, "someone/cached-base")
    (tmp_path / "config-only").mkdir()
    shutil.copy(base / "config.json", tmp_path / "config-only")
    snapshot = put_in_hub_cache(tmp_path / "config-only", "someone/cached-base", "e" * 40)
    with pytest.raises(RemoteBase, match="someone/cached-base is remote"):
        vitkit.load_checkpoint(folder)
    code, _, err = run_cli(capsys, "info", str(folder))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not fetched" in err, err
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json"]  # nothing fetched, nothing removed
    shutil.copy(base / "model.safetensors", snapshot)
    assert vitkit.load_checkpoint(folder).model.cfg.num_classes == 5


def test_a_local_base_still_loads(tmp_path: Path) -> None:
    assert vitkit.load_checkpoint(_adapters(tmp_path, str(NPZ))).model.cfg.num_classes == 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["lora"].update(rank=10**9), r"LoRA rank must be an integer in 1\.\.4096"),
        (lambda d: d["lora"].update(rank=100), "LoRA rank 100 is above the model's width 48"),
        (lambda d: d["lora"].update(dropout=float("nan")), "dropout must be a finite number"),
        (lambda d: d["model"].update(num_classes=9_000_000), "does not hold the head of a 9000000-class model"),
        (lambda d: d["model"].update(image_size=[8192, 8192]), "1048576 tokens, more than the 16384"),
        (lambda d: d["preprocess"].update(image_size=[60000, 60000]), '"preprocess" image size'),
    ],
)
def test_size_fields_are_bounded_before_anything_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, message: str
) -> None:
    """Each is one line before the base is even read (before the code sized a head, a position embedding or
    adapter matrices by them)."""
    folder = _adapters(tmp_path, str(NPZ))
    _edit(folder, change)
    import vitkit.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "load_checkpoint", lambda *a, **k: pytest.fail("the base was read"))
    with pytest.raises(CheckpointError, match=message):
        checkpoints.read_checkpoint(folder)


def test_a_config_json_of_gigabytes_is_not_read(tmp_path: Path) -> None:
    folder = _adapters(tmp_path, str(NPZ))
    with open(folder / "config.json", "r+b") as f:
        f.seek(64 << 20)
        f.write(b" ")  # sparse: 64 MiB of zeros after the JSON
    with pytest.raises(CheckpointError, match="more than 16 MiB"):
        vitkit.load_checkpoint(folder, format="lora")
    with pytest.raises(CheckpointError, match="not a checkpoint in any known format"):
        vitkit.load_checkpoint(folder)  # detection reads no more than the cap either
