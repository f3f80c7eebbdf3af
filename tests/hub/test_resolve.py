"""Checkpoints by name: URLs (loopback server), registry names (cache), Hugging Face Hub ids (a hub cache laid
out in a temp dir, offline), and the rules between them. A model loaded by name equals the same file loaded by
path exactly."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from loopback_http import (  # noqa: F401 (fixtures)
    Server,
    http_server_fixture,
    private_caches_fixture,
    put_in_hub_cache,
)

from helpers import FIXTURES, SRC, randomize_
from vitkit.checkpoints import load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError
from vitkit.hub import lookup
from vitkit.hub.download import cache_path
from vitkit.models import create_model

transformers = pytest.importorskip("transformers")

NPZ = FIXTURES / "official_vit_tiny.npz"
X = torch.randn(3, 3, 32, 32)


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    weights = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)
    with torch.no_grad():
        outputs = float((a(X) - b(X)).abs().max())
    return max(weights, outputs)


def test_url_loads_equal_to_the_file(http_server: Server, tmp_path: Path) -> None:
    http_server.files["/models/official_vit_tiny.npz"] = NPZ.read_bytes()
    by_url = load_checkpoint(http_server.url("/models/official_vit_tiny.npz"), cache_dir=tmp_path)
    by_path = load_checkpoint(NPZ)
    assert max_abs_diff(by_url.model, by_path.model) == 0.0
    assert by_url.meta.provenance["resolved"]["kind"] == "url"
    load_checkpoint(http_server.url("/models/official_vit_tiny.npz"), cache_dir=tmp_path)
    assert len(http_server.log) == 1  # the second load came from the cache


def test_registry_name_loads_the_cached_file_exactly(tmp_path: Path) -> None:
    entry = lookup("ViT-B_16-i21k-i1k-384")
    assert entry is not None and entry.url == "gs://vit_models/imagenet21k+imagenet2012/ViT-B_16.npz"
    target = cache_path(entry.url, tmp_path)
    https = "https://storage.googleapis.com/vit_models/imagenet21k%2Bimagenet2012/ViT-B_16.npz"
    digest = hashlib.sha256(https.encode()).hexdigest()[:32]  # the whole URL's: the name is the URL's own
    assert target.relative_to(tmp_path).parts == (
        "downloads", "storage.googleapis.com", "vit_models", "imagenet21k+imagenet2012", f"ViT-B_16.npz@{digest}",
        "ViT-B_16.npz",
    )  # fmt: skip
    target.parent.mkdir(parents=True)
    shutil.copyfile(NPZ, target)  # stands in for the downloaded file (no internet in tests)
    by_name = load_checkpoint("vit-b_16-i21k-i1k-384", cache_dir=tmp_path)  # case-insensitive
    assert max_abs_diff(by_name.model, load_checkpoint(NPZ).model) == 0.0
    assert by_name.meta.provenance["registry"]["name"] == "ViT-B_16-i21k-i1k-384"
    assert by_name.meta.provenance["registry"]["top1"] == 83.97


def test_ambiguous_and_unknown_names_say_what_was_tried() -> None:
    with pytest.raises(CheckpointError, match=r"ViT-L_16: ambiguous registry name, matches ViT-L_16-i21k, "):
        load_checkpoint("ViT-L_16")
    with pytest.raises(CheckpointError, match=r"S_16-i21k: ambiguous.*S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03"):
        load_checkpoint("S_16-i21k")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint("ViT-B_61-i21k")
    msg = str(e.value)
    assert msg.startswith("ViT-B_61-i21k: no such file or directory; registry: no such name (close: ViT-B_16-i21k")
    assert "Hugging Face Hub id" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match=r"^/no/such.npz: no such file or directory"):
        load_checkpoint("/no/such.npz")


# ---- Hugging Face Hub ids, from a hub cache laid out in a temp dir (offline) --------------------------


def hf_folder(path: Path, seed: int) -> Path:
    """A real transformers ViTForImageClassification folder (written by transformers itself)."""
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=32,
        patch_size=8, num_labels=3, id2label={0: "cat", 1: "dog", 2: "fox"}, label2id={"cat": 0, "dog": 1, "fox": 2},
    )  # fmt: skip
    model = transformers.ViTForImageClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def test_hub_ids_with_revisions_load_equal_to_the_folders(tmp_path: Path) -> None:
    a, b = hf_folder(tmp_path / "a", 1), hf_folder(tmp_path / "b", 2)
    put_in_hub_cache(a, "acme/tiny-vit", "a" * 40)
    put_in_hub_cache(b, "acme/tiny-vit", "b" * 40, refs=("v2",))
    main_rev = load_checkpoint("acme/tiny-vit")
    assert max_abs_diff(main_rev.model, load_checkpoint(a).model) == 0.0
    assert main_rev.meta.class_names == ["cat", "dog", "fox"]
    assert main_rev.meta.provenance["resolved"] == {"name": "acme/tiny-vit", "kind": "hub", "repo_id": "acme/tiny-vit"}
    for rev in ("v2", "b" * 40):
        assert max_abs_diff(load_checkpoint(f"acme/tiny-vit@{rev}").model, load_checkpoint(b).model) == 0.0
    with pytest.raises(CheckpointError, match=r"acme/other: no such file or directory; .*not in the local Hugging"):
        load_checkpoint("acme/other")


def test_timm_hub_id(tmp_path: Path) -> None:
    model = randomize_(create_model("Ti/16", image_size=32, num_classes=1000))
    folder = save_checkpoint(model, tmp_path / "timm-folder", "timm")
    put_in_hub_cache(folder, "timm/vit_tiny_patch16_32.test", "c" * 40)
    loaded = load_checkpoint("timm/vit_tiny_patch16_32.test")
    assert loaded.meta.format == "timm"
    assert max_abs_diff(loaded.model, load_checkpoint(folder).model) == 0.0
    assert loaded.meta.class_names is not None and loaded.meta.class_names[207] == "golden retriever"


def test_a_local_path_wins_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put_in_hub_cache(hf_folder(tmp_path / "hub", 1), "acme/tiny-vit", "a" * 40)
    monkeypatch.chdir(tmp_path)
    local = randomize_(create_model("Ti/16", image_size=32, num_classes=3))
    save_checkpoint(local, Path("acme/tiny-vit"), "vitkit")
    loaded = load_checkpoint("acme/tiny-vit")
    assert loaded.meta.format == "vitkit" and loaded.meta.provenance.get("resolved") is None
    assert max_abs_diff(loaded.model, local.eval()) == 0.0


def test_predict_with_a_hub_id_in_offline_mode(tmp_path: Path, sample_jpeg: Path) -> None:
    """The real environment-variable route: a fresh process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set."""
    hub = tmp_path / "hub-cache"
    folder = hf_folder(tmp_path / "f", 3)
    repo = hub / "models--acme--tiny-vit"
    shutil.copytree(folder, repo / "snapshots" / ("d" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)
    env: dict[str, Any] = {
        **os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub),
        "VITKIT_HOME": str(tmp_path / "vk"),
    }  # fmt: skip
    outs = []
    for ckpt in ("acme/tiny-vit", str(folder)):
        proc = subprocess.run(
            [sys.executable, "-m", "vitkit", "predict", "-c", ckpt, str(sample_jpeg), "--json", "--top-k", "3"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    assert {t["label"] for t in outs[0]["top"]} == {"cat", "dog", "fox"}
