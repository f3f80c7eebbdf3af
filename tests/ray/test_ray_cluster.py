"""``vitkit embed --ray`` on a simulated two-node cluster (``ray.cluster_utils.Cluster``, one CPU a node: the
model actor on one node, the decoding tasks on the other) writes the local job's file."""

# ruff: noqa: F811  (the fixtures imported from test_ray_jobs are parameters of the test)
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli

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
    from vitkit.outputs.arrays import read_embeddings

    assert len(ray.nodes()) == 2
    common = ["embed", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8", "--skip-bad"]
    local, on_ray = tmp_path / "local.parquet", tmp_path / "ray.parquet"
    assert run_cli(capsys, *common, "--out", str(local))[0] == 0
    code, _, err = run_cli(capsys, *common, "--out", str(on_ray), "--ray")
    assert code == 0, err
    a, b = read_embeddings(local), read_embeddings(on_ray)
    assert a.ids == b.ids and np.array_equal(a.vectors, b.vectors, equal_nan=True)
    assert local.read_bytes() == on_ray.read_bytes()
