"""The shipped registry and label files: consistent, sourced, and the docs' table generated from them."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import pytest

from helpers import meta_model
from vitkit.hub import entries, label_names, lookup, search
from vitkit.hub.registry import AmbiguousName, markdown_table

MODELS_PAGE = Path(__file__).parents[2] / "docs" / "pretrained-models.md"


def test_entries_are_unique_sourced_and_consistent() -> None:
    all_entries = entries()
    names = [e.name.lower() for e in all_entries] + [a.lower() for e in all_entries for a in e.aliases]
    assert len(names) == len(set(names))
    assert len(all_entries) >= 50
    for e in all_entries:
        assert e.url.startswith("gs://vit_models/") and e.url.endswith(".npz")
        assert e.source.startswith(("https://github.com/google-research/vision_transformer", "timm "))
        assert (e.top1 is None) == (e.top1_source is None)
        assert e.label_set == {1000: "imagenet-1k", 21843: "imagenet-21k"}[e.num_classes]
        assert (e.finetune is None) == (e.num_classes == 21843)
        if e.family == "augreg":
            assert e.url.endswith(f"/augreg/{e.name}.npz")
            assert e.resolution == (int(e.name.rsplit("res_", 1)[1]) if "res_" in e.name else 224)


@pytest.mark.parametrize("name", ["ViT-H_14-i21k", "R50+ViT-B_16-i21k-i1k-384", "ViT-B_32-i21k-i1k-384"])
def test_parameter_counts_match_the_architecture(name: str) -> None:
    e = lookup(name)
    assert e is not None
    model = meta_model(e.architecture, num_classes=0, image_size=e.resolution)
    assert sum(p.numel() for p in model.parameters()) == e.params_without_head


def test_published_numbers() -> None:
    """Spot checks against the publications (see tools/build_registry.py for every source)."""
    assert lookup("ViT-L_16-i21k-i1k-384").top1 == 85.15  # type: ignore[union-attr]  # paper, Table 5
    assert lookup("ViT-B_16-i21k-i1k-224").top1 == 81.2  # type: ignore[union-attr]  # README update 29.10.2020
    recommended = "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"
    assert lookup(recommended).top1 == 85.49  # type: ignore[union-attr]


def test_lookup_rules() -> None:
    assert lookup("no-such-model") is None
    assert lookup("vit-h_14") is not None and lookup("vit-h_14").name == "ViT-H_14-i21k"  # type: ignore[union-attr]
    exact = "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0"  # also the prefix of its fine-tunes
    assert lookup(exact).name == exact and lookup(exact + ".npz").name == exact  # type: ignore[union-attr]
    with pytest.raises(AmbiguousName, match="R_Ti_16: ambiguous registry name, matches R_Ti_16-i21k"):
        lookup("R_Ti_16")
    assert {e.architecture for e in search("R26")} == {"R26+S/32"}


def test_shipped_label_sets() -> None:
    i1k = label_names("imagenet-1k")
    assert len(i1k) == 1000 and len(set(i1k)) == 999  # WordNet names two classes "crane" (the bird, the machine)
    assert [i for i, n in enumerate(i1k) if n == "crane"] == [134, 517]
    assert i1k[0] == "tench, Tinca tinca" and i1k[207] == "golden retriever"
    i21k = label_names("imagenet-21k")
    shipped = resources.files("vitkit").joinpath("resources", "imagenet21k_labels.tsv.gz").read_bytes()
    synsets = [line.split("\t", 1)[0] for line in gzip.decompress(shipped).decode("utf-8").splitlines()]
    assert len(i21k) == len(synsets) == 21843 and len(set(synsets)) == 21843
    assert synsets[0] == "n00004475" and all(s[0] == "n" and len(s) == 9 for s in synsets)


def test_pretrained_models_page_table_is_the_generated_one() -> None:
    text = MODELS_PAGE.read_text()
    table = text.split("<!-- registry-table:start -->\n", 1)[1].split("<!-- registry-table:end -->", 1)[0]
    assert table == markdown_table(), "the page is stale: run PYTHONPATH=src python tools/registry_table.py"


def test_models_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    from helpers import run_cli

    code, out, _ = run_cli(capsys, "models", "--filter", "i21k-i1k", "--cache-dir", str(tmp_path))
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["name", "arch", "params"]
    row = next(line for line in lines if line.startswith("ViT-L_16-i21k-i1k-384 "))
    assert row.split()[1:] == ["L/16", "303.7M", "384", "ImageNet-21k", "ImageNet-1k", "85.15", "no"]
    assert lines[-1].startswith("7 models")
    code, out, _ = run_cli(capsys, "models", "--filter", "R_Ti_16", "--json", "--cache-dir", str(tmp_path))
    rows = json.loads(out)
    assert code == 0 and {r["architecture"] for r in rows} == {"R+Ti/16"} and len(rows) == 3
    assert all(r["cached"] is False and r["url"].startswith("gs://vit_models/augreg/R_Ti_16") for r in rows)
    assert run_cli(capsys, "models", "--filter", "no-such-thing")[0] == 1
