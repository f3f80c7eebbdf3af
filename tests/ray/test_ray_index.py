"""``vitkit index -c CKPT FOLDER --ray``: the embedding on the way runs on Ray (vitkit.ray) and the index is the
local ``vitkit index``'s: the same ids in the same order, the same vectors (fp32, exactly); ``--ray`` without
``-c`` (an embed output to index: nothing to run) is one line, exit 2, nothing written."""

# ruff: noqa: F811  (the fixtures imported from test_ray_jobs are parameters of the test)
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from test_ray_jobs import ckpt, cluster, images  # noqa: E402, F401  (the same cluster, checkpoint and images)

pytestmark = pytest.mark.slow


def test_index_on_ray_is_the_local_index(
    capsys: pytest.CaptureFixture[str], cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    from vitkit.search.index import Index

    common = ["index", "-c", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8", "--skip-bad"]
    code, _, err = run_cli(capsys, *common, "--out", str(tmp_path / "local"))
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--out", str(tmp_path / "ray"), "--ray")
    assert code == 0, err
    a, b = Index.open(tmp_path / "local"), Index.open(tmp_path / "ray")
    assert len(a.ids) == 60 and a.ids == b.ids  # the 4 bad files left out of both
    assert a.vectors.dtype == b.vectors.dtype == np.float32 and np.array_equal(a.vectors, b.vectors)
    names = [sorted(p.name for p in (tmp_path / name).iterdir()) for name in ("local", "ray")]
    assert names[0] == names[1]  # the same files: no side file of the embedding left behind


def test_ray_without_a_checkpoint_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "idx"
    code, _, err = run_cli(capsys, "index", str(tmp_path / "v.parquet"), "--out", str(out), "--ray")
    assert code == 2 and "--ray: only with -c" in err.strip().splitlines()[-1] and not out.exists()
