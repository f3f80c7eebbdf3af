"""The families' registry (resources/vit_families.json): names unique beside Google's registry, every count
vitkit's own model of the loader's config, and the same count as the reference packages' models built from
the entry's config with random weights (meta device: no memory, nothing downloaded)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import run_cli
from vitkit.checkpoints.families import loader_config, param_count, registry_config
from vitkit.errors import CheckpointError
from vitkit.hub import entries, families, resolve
from vitkit.hub.families import FAMILIES, FamilyEntry

LOADABLE = [e for e in families.entries() if not e.refused]
TIMM = [e for e in LOADABLE if e.format in ("timm", "timm_eva")]


def entry(name: str) -> FamilyEntry:
    found = families.lookup(name)
    assert found is not None, name
    return found


def test_names_are_unique_across_both_registries_and_entries_are_honest() -> None:
    names = [n.lower() for e in families.entries() for n in e.names]
    names += [n.lower() for e in entries() for n in (e.name, *e.aliases)]
    assert len(names) == len(set(names))
    defaults = {"dinov2": "class token", "siglip": "MAP output", "clip": "projected embedding"}
    for e in families.entries():
        assert e.family in FAMILIES and e.format in ("hf", "timm", "timm_eva")
        assert e.sha256 is None and e.size_mib is None  # unknown here: huggingface_hub checks and caches them
        assert e.repo_id == e.name and (e.format != "hf") == e.repo_id.startswith("timm/")
        if e.family in defaults:
            assert e.embedding == defaults[e.family]
        assert (e.params == 0) == bool(e.refused)
    assert {e.family for e in LOADABLE} == set(FAMILIES) and len(LOADABLE) >= 40


def test_the_names_the_issue_asks_for() -> None:
    for name in ("facebook/dinov2-small", "facebook/dinov2-base", "facebook/dinov2-with-registers-small",
                 "facebook/dinov2-with-registers-base", "google/siglip-base-patch16-224",
                 "google/siglip2-base-patch16-256", "openai/clip-vit-base-patch16", "openai/clip-vit-base-patch32",
                 "facebook/deit-small-distilled-patch16-224", "facebook/deit-base-distilled-patch16-224",
                 "vit_small_patch14_reg4_dinov2.lvd142m", "vit_base_patch16_siglip_224.webli",
                 "vit_base_patch16_clip_224.openai", "deit_small_distilled_patch16_224.fb_in1k"):  # fmt: skip
        assert not entry(name).refused, name
    assert entry("DINOv2-small@main").name == "facebook/dinov2-small"
    assert entry("vit_small_patch14_reg4_dinov2.lvd142m").repo_id == "timm/vit_small_patch14_reg4_dinov2.lvd142m"
    siglip2 = entry("google/siglip2-base-patch16-256")
    assert siglip2.config["model_type"] == "siglip" and siglip2.embedding == "MAP output"
    assert families.lookup("dinov2") is None  # exact names only: no prefixes among names this alike


@pytest.mark.parametrize("name", ["google/siglip2-base-patch16-naflex", "vit_so400m_patch14_siglip_384.webli"])
def test_refused_entries_are_one_line_before_any_request(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    resolve_module = importlib.import_module("vitkit.hub.resolve")  # (vitkit.hub.resolve is also the function)

    def refuse(*args: Any) -> Any:
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(resolve_module, "fetch_hub", refuse)
    with pytest.raises(CheckpointError) as e:
        resolve(name)
    assert "cannot be loaded by vitkit" in str(e.value) and "\n" not in str(e.value)
    assert ("NaFlex" if "naflex" in name else "no multiple of the 14 px patch") in str(e.value)


@pytest.mark.parametrize("e", LOADABLE, ids=lambda e: e.name)
def test_every_count_is_vitkits_model_of_the_loaders_config(e: FamilyEntry) -> None:
    cfg = registry_config(e)
    assert param_count(cfg) == e.params
    if e.format == "hf":
        assert loader_config(e) == cfg  # what vitkit's transformers loader builds from these config.json fields


def _meta(build: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return build()


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_counts_equal_transformers_models_of_the_same_configs() -> None:
    t = pytest.importorskip("transformers")

    def hf_fields(e: FamilyEntry) -> dict[str, Any]:
        return {k: v for k, v in e.config.items() if k != "model_type"}

    for name, cls in (("facebook/dinov2-small", t.Dinov2Model), ("facebook/dinov2-giant", t.Dinov2Model),
                      ("facebook/dinov2-with-registers-base", t.Dinov2WithRegistersModel)):  # fmt: skip
        e = entry(name)
        config_cls = t.Dinov2WithRegistersConfig if "registers" in name else t.Dinov2Config
        config = config_cls(**hf_fields(e))
        model = _meta(lambda: cls(config))  # noqa: B023 (called at once)
        assert _numel(model) - model.embeddings.mask_token.numel() == e.params, name  # mask_token: not loaded
    e = entry("google/siglip2-base-patch16-256")
    assert _numel(_meta(lambda: t.SiglipVisionModel(t.SiglipVisionConfig(**e.config["vision_config"])))) == e.params
    e = entry("openai/clip-vit-large-patch14")
    vision = t.CLIPVisionConfig(**e.config["vision_config"], projection_dim=e.config["projection_dim"])
    assert _numel(_meta(lambda: t.CLIPVisionModelWithProjection(vision))) == e.params
    e = entry("facebook/deit-small-distilled-patch16-224")
    deit = t.DeiTConfig(**hf_fields(e))
    assert _numel(_meta(lambda: t.DeiTForImageClassificationWithTeacher(deit))) == e.params


@pytest.fixture(scope="module")
def timm_vt() -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
    from timm_real import import_timm

    vt = import_timm()
    if vt is None:
        pytest.skip("timm is not installed")
    return vt


@pytest.mark.parametrize("e", TIMM, ids=lambda e: e.name)
def test_timm_entries_are_what_the_loader_reads_from_real_timms_state_dict(e: FamilyEntry, timm_vt: Any) -> None:
    """timm builds the entry's architecture (meta tensors); vitkit's timm loader reads its state dict with the
    entry's config.json and load_options: the config the entry declares, and timm's parameter count."""
    import timm

    from vitkit.checkpoints import timm_eva, timm_eva02, timm_format

    arch, args = e.config["architecture"], e.config["model_args"]
    model = _meta(lambda: timm.create_model(arch, pretrained=False, **args))
    state = model.state_dict()
    res = registry_config(e).image_size
    sidecar = {"architecture": arch, "num_classes": args.get("num_classes", 0),
               "pretrained_cfg": {"input_size": [3, *res]}, "global_pool": e.config.get("global_pool")}  # fmt: skip
    if e.format == "timm_eva":  # timm's DINOv3, EVA-02: its hub config holds the architecture and global_pool only
        reader = timm_eva02.infer_config if e.family == "eva02" else timm_eva.infer_config
        assert reader(state, sidecar, e.name)[0] == registry_config(e)
        assert _numel(model) == e.params
        return
    cfg, layout = timm_format.infer_config(state, sidecar, e.name, **e.load_options)
    assert cfg == registry_config(e)
    # registers without a class slot (no_embed_class): vitkit keeps the class token's slot, as zeros
    slot = cfg.hidden_size if layout.no_embed_class else 0
    assert _numel(model) + slot == e.params


def test_models_command_lists_a_family(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "models", "--family", "dinov2", "--cache-dir", str(tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["name", "family", "arch", "params", "res", "format", "embedding", "cached"]
    row = next(r for r in lines if r.startswith("facebook/dinov2-small "))
    assert row.split() == ["facebook/dinov2-small", "dinov2", "S/14", "22.1M", "224", "hf", "class", "token", "no"]
    assert any(r.startswith("timm/vit_small_patch14_reg4_dinov2.lvd142m ") and "S/14+reg4" in r for r in lines)
    assert not any("ViT-B_16" in r or "siglip" in r for r in lines)
    assert lines[-1].startswith("14 family checkpoints (0 refused")
    code, out, _ = run_cli(capsys, "models", "--family", "siglip", "--filter", "naflex", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == ["google/siglip2-base-patch16-naflex"]
    assert "NaFlex" in rows[0]["refused"] and rows[0]["cached"] is False
    code, out, _ = run_cli(capsys, "models", "--family", "paper", "--filter", "i21k-i1k", "--cache-dir", str(tmp_path))
    lines = out.splitlines()
    assert code == 0 and lines[-1].startswith("7 models") and not any("family checkpoints" in r for r in lines)
