"""Family registry names download from a Hugging Face Hub endpoint (a loopback server speaking the Hub's file
protocol: HEAD with X-Repo-Commit and ETag, then GET), land in huggingface_hub's cache, load from it offline,
and equal the same folder loaded by path. Nothing is downloaded from the internet."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from loopback_http import private_caches_fixture  # noqa: F401 (fixture)

from helpers import randomize_, run_cli
from vitkit.checkpoints import load_checkpoint, load_pretrained
from vitkit.errors import CheckpointError

transformers = pytest.importorskip("transformers")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    """Files by ``/<repo>/resolve/<revision>/<name>``; ``log``: (method, path) of every request."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []
        self.base = ""

    def publish(self, repo_id: str, folder: Path) -> None:
        for f in folder.iterdir():
            self.files[f"/{repo_id}/resolve/main/{f.name}"] = f.read_bytes()


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: bool) -> None:
            path = self.path.split("?")[0]
            hub.log.append((self.command, path))
            data = hub.files.get(path)
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

    return Handler


@pytest.fixture(name="hub")
def hub_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A loopback Hub endpoint; huggingface_hub online and pointed at it (its cache: private_caches')."""
    import huggingface_hub.constants as c

    hub = HubServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "ENDPOINT", hub.base)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.base + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def tiny_dinov2(folder: Path) -> torch.nn.Module:
    """A random transformers Dinov2Model folder written by transformers (with its BitImageProcessor config)."""
    torch.manual_seed(0)
    cfg = transformers.Dinov2Config(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, image_size=28, patch_size=14, layerscale_value=0.5
    )
    model = transformers.Dinov2Model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    processor = transformers.BitImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}, image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225], resample=3, do_convert_rgb=True,
    )  # fmt: skip
    processor.save_pretrained(folder)
    return model


def test_a_family_name_downloads_from_the_hub_and_loads_exactly(hub: HubServer, tmp_path: Path) -> None:
    import huggingface_hub.constants as c

    reference = tiny_dinov2(tmp_path / "dinov2")
    hub.publish("facebook/dinov2-small", tmp_path / "dinov2")
    loaded = load_checkpoint("DINOv2-small")  # the short alias, any letter case
    assert loaded.meta.provenance["resolved"] == {
        "name": "DINOv2-small",
        "kind": "hub",
        "repo_id": "facebook/dinov2-small",
    }
    registry = loaded.meta.provenance["registry"]
    assert registry["name"] == "facebook/dinov2-small" and registry["embedding"] == "class token"
    gets = [p for m, p in hub.log if m == "GET"]
    assert "/facebook/dinov2-small/resolve/main/config.json" in gets
    assert "/facebook/dinov2-small/resolve/main/model.safetensors" in gets
    snapshot = Path(c.HF_HUB_CACHE) / "models--facebook--dinov2-small" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "preprocessor_config.json").is_file()

    by_path = load_checkpoint(tmp_path / "dinov2")
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        ours = loaded.model(x)
        assert torch.equal(ours, by_path.model(x))
        theirs = reference(pixel_values=x).pooler_output  # the class token after the final LayerNorm
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
    assert loaded.meta.preprocess == by_path.meta.preprocess and loaded.meta.preprocess.resize == "shortest"

    c.HF_HUB_OFFLINE = True  # the cache serves it now (monkeypatch restores the flag)
    hub.log.clear()
    offline = load_pretrained("facebook/dinov2-small")
    assert hub.log == []
    with torch.no_grad():
        assert torch.equal(offline(x), ours)


def test_models_and_download_see_the_hub_cache(
    hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_dinov2(tmp_path / "dinov2")
    hub.publish("facebook/dinov2-small", tmp_path / "dinov2")
    code, out, err = run_cli(capsys, "models", "--family", "dinov2", "--filter", "facebook/dinov2-small")
    assert code == 0, err
    assert next(r for r in out.splitlines() if r.startswith("facebook/dinov2-small ")).split()[-1] == "no"
    code, out, err = run_cli(capsys, "download", "dinov2-small", "--quiet")
    assert code == 0 and out.startswith("dinov2-small: ") and out.rstrip().endswith("(Hugging Face cache)"), err
    code, out, _ = run_cli(capsys, "models", "--family", "dinov2", "--filter", "facebook/dinov2-small")
    assert next(r for r in out.splitlines() if r.startswith("facebook/dinov2-small ")).split()[-1] == "yes"


def test_a_repository_missing_on_the_hub_is_one_line(hub: HubServer) -> None:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint("facebook/dinov2-with-registers-small")
    msg = str(e.value)
    assert msg.startswith("facebook/dinov2-with-registers-small: registry dinov2 checkpoint")
    assert "config.json" in msg and "\n" not in msg


def test_a_timm_name_loads_with_what_timms_hub_config_leaves_out(hub: HubServer, tmp_path: Path) -> None:
    """timm's hub config.json names the architecture but not its act_layer: the registry entry supplies it
    (timm's SigLIP towers run exact GELU), so the name loads equal to timm; the bare folder is refused. The
    width is a paper width (192: 3 heads), as timm's configs leave the heads to the width too."""
    import json
    import sys

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
    from timm_real import import_timm

    vt = import_timm()
    if vt is None:
        pytest.skip("timm is not installed")
    torch.manual_seed(1)
    model = randomize_(vt.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=192, depth=2, num_heads=3, class_token=False, global_pool="map",
        num_classes=0,
    )).eval()  # fmt: skip
    folder = tmp_path / "siglip"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config = {"architecture": "vit_base_patch16_siglip_224", "num_classes": 0, "num_features": 192,
              "global_pool": "map", "pretrained_cfg": {"input_size": [3, 32, 32], "interpolation": "bicubic",
              "crop_pct": 0.9, "mean": [0.5] * 3, "std": [0.5] * 3, "num_classes": 0}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    hub.publish("timm/vit_base_patch16_siglip_224.webli", folder)

    loaded = load_checkpoint("vit_base_patch16_siglip_224.webli")
    assert loaded.meta.format == "timm" and loaded.meta.provenance["registry"]["load_options"] == {"gelu": "exact"}
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours, theirs = loaded.model(x), model(x)
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
    with pytest.raises(CheckpointError, match=r"no model_args.act_layer; pass gelu="):
        load_checkpoint(folder)


def test_a_timm_dinov3_name_loads_through_the_eva_format(hub: HubServer, tmp_path: Path) -> None:
    """``vit_small_patch16_dinov3.lvd1689m`` from the Hub (a timm folder as timm's hub holds it: model.safetensors
    and a config.json with the architecture, global_pool "avg" and pretrained_cfg, no model_args) loads through the
    timm_eva format, equal to timm's own Eva of the same weights."""
    import json
    import sys

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
    from timm_real import import_timm

    if import_timm() is None:
        pytest.skip("timm is not installed")
    import timm

    torch.manual_seed(2)
    model = randomize_(timm.create_model("vit_small_patch16_dinov3", pretrained=False, img_size=64), std=0.02).eval()
    folder = tmp_path / "dinov3"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config = {"architecture": "vit_small_patch16_dinov3", "num_classes": 0, "num_features": 384, "global_pool": "avg",
              "pretrained_cfg": {"input_size": [3, 64, 64], "interpolation": "bicubic", "crop_pct": 1.0,
              "crop_mode": "center", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    hub.publish("timm/vit_small_patch16_dinov3.lvd1689m", folder)
    loaded = load_checkpoint("vit_small_patch16_dinov3.lvd1689m")
    assert loaded.meta.format == "timm_eva" and loaded.model.cfg.classifier == "gap"
    assert loaded.meta.provenance["num_heads"].startswith("6 (the DINOv3 entry point")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ours, theirs = loaded.model(x), model(x)
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
