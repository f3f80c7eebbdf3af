"""``vitkit index``, ``search`` and ``dedup`` end to end on a few tiny images with a tiny random checkpoint:
indexing images (-c) and embed's output, searching by image, id and --vectors, JSONL/CSV, near-duplicate groups
with their plot, --add and --remove, and queries or additions made with another checkpoint refused in one line."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import run_cli, tiny_checkpoint
from vitkit.search import Index


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("search")
    imgs = root / "imgs"
    imgs.mkdir()
    for i in range(8):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(imgs / f"{i}.png")
    shutil.copy(imgs / "3.png", imgs / "3-copy.png")  # a planted duplicate
    return {"root": root, "imgs": imgs, "ckpt": tiny_checkpoint(root / "a", ["x", "y"]),
            "other": tiny_checkpoint(root / "b", ["x", "y"])}  # fmt: skip


def test_index_search_dedup_from_images(capsys: pytest.CaptureFixture[str], setup: dict[str, Path]) -> None:
    root, imgs, ckpt = setup["root"], setup["imgs"], setup["ckpt"]
    ix = root / "ix"
    code, _, err = run_cli(capsys, "index", str(imgs), "--out", str(ix), "-c", str(ckpt), "--precision", "fp32")
    assert code == 0, err
    index = Index.open(ix)
    assert len(index) == 9 and index.provenance["vitkit.embed.pool"] == "pre-logits"
    assert not list(root.glob(".ix.*")), "the embeddings made on the way are removed"
    code, out, err = run_cli(capsys, "search", str(ix), str(imgs / "3.png"), "id:" + str(imgs / "5.png"),
                             "--top-k", "3", "--out", str(root / "r.jsonl"))  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in (root / "r.jsonl").read_text().splitlines()]
    assert [r["query"] for r in rows] == [str(imgs / "3.png"), "id:" + str(imgs / "5.png")]
    assert {n["id"] for n in rows[0]["neighbours"][:2]} == {str(imgs / "3.png"), str(imgs / "3-copy.png")}
    assert rows[0]["neighbours"][0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert all(n["id"] != str(imgs / "5.png") for n in rows[1]["neighbours"]) and len(rows[1]["neighbours"]) == 3
    code, out, _ = run_cli(capsys, "search", str(ix), str(imgs / "1.png"), "--top-k", "2")
    assert code == 0 and str(imgs / "1.png") in out and "score" in out
    code, _, err = run_cli(capsys, "dedup", str(ix), "--out", str(root / "g.csv"), "--threshold", "0.999")
    assert code == 0, err
    groups = list(csv.DictReader((root / "g.csv").open()))
    assert [(g["group"], g["image"]) for g in groups] == [("0", str(imgs / "3-copy.png")), ("0", str(imgs / "3.png"))]
    assert (root / "g.scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_embed_output_add_remove_and_other_checkpoint(capsys: pytest.CaptureFixture[str],
                                                       setup: dict[str, Path]) -> None:  # fmt: skip
    root, imgs, ckpt, other = setup["root"], setup["imgs"], setup["ckpt"], setup["other"]
    first = [str(imgs / f"{i}.png") for i in range(5)]
    rest = [str(imgs / f"{i}.png") for i in range(5, 8)]
    for name, files, c in (("a.npy", first, ckpt), ("b.parquet", rest, ckpt), ("o.npy", rest, other)):
        code, _, err = run_cli(capsys, "embed", str(c), *files, "--out", str(root / name), "--precision", "fp32")
        assert code == 0, err
    ix = root / "ix2"
    code, _, err = run_cli(capsys, "index", str(root / "a.npy"), "--out", str(ix), "--backend", "exact")
    assert code == 0, err
    code, _, err = run_cli(capsys, "index", "--add", str(root / "b.parquet"), str(ix))
    assert code == 0 and "added 3" in err, err
    assert Index.open(ix).ids == first + rest
    code, _, err = run_cli(capsys, "index", "--add", str(root / "b.parquet"), str(ix))
    assert code == 0 and "added 0" in err  # again: nothing twice
    for argv in (["index", "--add", str(root / "o.npy"), str(ix)],
                 ["search", str(ix), "--vectors", str(root / "o.npy")],
                 ["search", str(ix), str(imgs / "1.png"), "-c", str(other)]):  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "checkpoint" in err, (argv, err)
    assert Index.open(ix).ids == first + rest
    code, _, err = run_cli(capsys, "search", str(ix), "--vectors", str(root / "b.parquet"), "--out",
                           str(root / "r.csv"), "--top-k", "1")  # fmt: skip
    assert code == 0, err
    got = list(csv.DictReader((root / "r.csv").open()))
    assert [(r["query"], r["id"]) for r in got] == [(f, f) for f in rest]
    code, _, err = run_cli(capsys, "index", "--remove", "id:" + first[0], str(ix))
    assert code == 0 and "removed 1" in err
    assert Index.open(ix).ids == first[1:] + rest
    code, _, err = run_cli(capsys, "search", str(ix), str(imgs / "1.png"))
    assert code == 2 and "-c" in err  # built from embed's output: the checkpoint is not known


def test_image_queries_embedded_at_the_index_precision(capsys: pytest.CaptureFixture[str],
                                                       setup: dict[str, Path]) -> None:  # fmt: skip
    """An image query is embedded at the precision its index records (bf16 here), not in fp32, so an indexed image
    queried by its file finds itself with the very vector it was indexed with (in fp32 its vector differs, by a few
    1e-3 a component: printed). bf16 rows do not depend on their batch mates; int8 activations are scaled per batch, so
    an int8 index cannot promise this."""
    root, imgs, ckpt = setup["root"], setup["imgs"], setup["ckpt"]
    ix = root / "ix-bf16"
    code, _, err = run_cli(capsys, "index", str(imgs), "--out", str(ix), "-c", str(ckpt), "--precision", "bf16")
    assert code == 0, err
    index = Index.open(ix)
    from vitkit.search import operations

    settings = operations.settings_of(index)
    assert index.provenance["vitkit.precision"] == settings.precision == "bf16"
    queries = [str(imgs / f"{i}.png") for i in (0, 3, 6)]
    q = operations.query_vectors(index, queries, settings=settings)
    for name, v in zip(queries, q.vectors, strict=True):
        np.testing.assert_allclose(v / np.linalg.norm(v), index.vector(name), atol=1e-6)
    # the same queries embedded in fp32 (what search did before): measurably off the indexed vectors
    fp32 = operations.query_vectors(index, queries, settings=dataclasses.replace(settings, precision="fp32"))
    pairs = zip(queries, fp32.vectors, strict=True)
    gap = max(float(np.abs(v / np.linalg.norm(v) - index.vector(n)).max()) for n, v in pairs)
    with capsys.disabled():  # the figure the docs quote (pytest -s)
        print(f"bf16 index: largest component difference of an fp32 query from its indexed vector {gap:.1e}")
    assert gap > 1e-4
    code, _, err = run_cli(capsys, "search", str(ix), queries[0], "--top-k", "1", "--out", str(root / "p.jsonl"))
    assert code == 0, err
    (row,) = [json.loads(line) for line in (root / "p.jsonl").read_text().splitlines()]
    assert row["neighbours"][0]["id"] == queries[0] and row["neighbours"][0]["score"] == pytest.approx(1.0, abs=1e-6)
