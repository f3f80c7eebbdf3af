"""``vitkit embed --ray`` and ``vitkit predict --ray`` on a simulated two-node cluster (``ray.cluster_utils.Cluster``,
one CPU a node: the model actor on one node, the decoding tasks on the other) write the local job's files: over
the small images of test_ray_jobs, and over 2,048 JPEGs with bad files among them (a Ti/16 at 64 px: labels,
scores, vectors and failed rows equal, the files byte for byte)."""

# ruff: noqa: F811  (the fixtures imported from test_ray_jobs are parameters of the test)
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import randomize_, run_cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from test_ray_jobs import ckpt, images  # noqa: E402, F401  (the same checkpoint and images, as fixtures)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_embed_on_two_nodes_writes_the_local_jobs_file(
    capsys: pytest.CaptureFixture[str],
    two_nodes: None,
    ckpt: Path,
    images: Path,
    tmp_path: Path,
) -> None:
    from vitkit.outputs.array_reader import read_embeddings

    assert len(ray.nodes()) == 2
    common = ["embed", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8", "--skip-bad"]
    local, on_ray = tmp_path / "local.parquet", tmp_path / "ray.parquet"
    assert run_cli(capsys, *common, "--out", str(local))[0] == 0
    code, _, err = run_cli(capsys, *common, "--out", str(on_ray), "--ray")
    assert code == 0, err
    a, b = read_embeddings(local), read_embeddings(on_ray)
    assert a.ids == b.ids and np.array_equal(a.vectors, b.vectors, equal_nan=True)
    assert local.read_bytes() == on_ray.read_bytes()


BAD = {  # position among the 2,048 files -> what is wrong with it
    5: "truncated",
    700: "empty",
    1201: "text",
    1750: "bomb",
    2047: "truncated",
}


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Ti/16 at 64 px with 6 classes, a folder of 2,048 JPEGs of assorted sizes of which the 5 of ``BAD``
    are bad: truncated, empty, text named .jpg, a header declaring 65,000 x 65,000 pixels)."""
    import vitkit
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.models import create_model

    root = tmp_path_factory.mktemp("many")
    model = randomize_(create_model("Ti/16", image_size=64, num_classes=6)).eval()
    ckpt = vitkit.save_pretrained(model, root / "m", preprocess=Preprocess(image_size=64),
                                  class_names=[f"c{i}" for i in range(6)])  # fmt: skip
    folder = root / "in"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(2048):
        w, h = int(rng.integers(48, 160)), int(rng.integers(48, 160))
        small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        path = folder / f"{i:04d}.jpg"
        Image.fromarray(small).resize((w, h), Image.BILINEAR).save(path, quality=85)
        bad = BAD.get(i)
        if bad == "truncated":
            path.write_bytes(path.read_bytes()[:60])
        elif bad == "empty":
            path.write_bytes(b"")
        elif bad == "text":
            path.write_text("not a jpeg")
        elif bad == "bomb":  # the frame header's height and width set to 65,000: refused from the header
            data = bytearray(path.read_bytes())
            sof = data.index(b"\xff\xc0")
            data[sof + 5 : sof + 9] = (65000).to_bytes(2, "big") * 2
            path.write_bytes(bytes(data))
    return ckpt, folder


def test_predict_and_embed_over_2048_jpegs_on_two_nodes_are_the_local_jobs(
    capsys: pytest.CaptureFixture[str], two_nodes: None, many: tuple[Path, Path], tmp_path: Path
) -> None:
    from vitkit.outputs.array_reader import read_embeddings

    ckpt, folder = many
    common = [str(folder), "--precision", "fp32", "--batch-size", "32", "--skip-bad"]
    predict = ["predict", "-c", str(ckpt), *common, "--top-k", "3", "--logits"]
    outs = {}
    for name, extra in (("local", []), ("ray", ["--ray"])):
        outs[name] = tmp_path / f"{name}.jsonl"
        code, _, err = run_cli(capsys, *predict, "--out", str(outs[name]), *extra)
        assert code == 0, err
        assert f"{len(BAD)} of 2048 image(s) failed" in err
    rows = [[json.loads(line) for line in outs[n].read_text().splitlines()] for n in ("local", "ray")]
    assert len(rows[0]) == 2048 and rows[0] == rows[1]  # ids, labels, probabilities, logits, errors
    failed = [k for k, r in enumerate(rows[1]) if r["error"]]
    assert failed == sorted(BAD)
    assert "pixels" in rows[1][1750]["error"] and "empty file" in rows[1][700]["error"]
    assert outs["local"].read_bytes() == outs["ray"].read_bytes()

    embed = ["embed", str(ckpt), *common]
    vectors = {}
    for name, extra in (("local", []), ("ray", ["--ray"])):
        vectors[name] = tmp_path / f"{name}.parquet"
        code, _, err = run_cli(capsys, *embed, "--out", str(vectors[name]), *extra)
        assert code == 0, err
    a, b = read_embeddings(vectors["local"]), read_embeddings(vectors["ray"])
    assert a.ids == b.ids and len(b.ids) == 2048
    assert np.array_equal(a.vectors, b.vectors, equal_nan=True)  # fp32, the failed rows NaN in both
    assert np.flatnonzero(np.isnan(b.vectors).all(axis=1)).tolist() == sorted(BAD)
    assert vectors["local"].read_bytes() == vectors["ray"].read_bytes()
