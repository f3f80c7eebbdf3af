"""Embedding files read back (``vitkit.outputs.array_reader.read_embeddings``): a damaged ids file or metadata
field is one line naming the file, never a traceback (issue 32, section 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli
from vitkit.outputs.arrays import EmbeddingWriter


def _bank(path: Path) -> Path:
    w = EmbeddingWriter(path, {})
    w.write({"index": [0, 1], "id": ["a", "b"], "label": [0, 1], "vector": np.ones((2, 4), np.float32)})
    w.close()
    return path


@pytest.mark.parametrize(
    "damage", [["not", "an", "object"], {"ids": "ab", "labels": [0, 1], "index": [0, 1]},
               {"ids": ["a", "b"], "labels": ["x", "y"], "index": [0, 1]}, {"ids": ["a", "b"], "labels": [0, 1],
               "index": [0, 1], "errors": {"one": "x"}}],
)  # fmt: skip
def test_a_damaged_ids_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, damage: object) -> None:
    out = _bank(tmp_path / "e.npy")
    (tmp_path / "e.ids.json").write_text(json.dumps(damage))
    code, _, err = run_cli(capsys, "knn", "--train-embeddings", str(out), "--test-embeddings", str(out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(out) in lines[0], err


def test_a_damaged_shape_field_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = _bank(tmp_path / "e.parquet")
    table = pq.read_table(out)
    for shape in (b"[3]", b"nonsense", b'{"a": 1}'):
        meta = {**(table.schema.metadata or {}), b"vitkit.shape": shape}
        pq.write_table(table.replace_schema_metadata(meta), out)
        code, _, err = run_cli(capsys, "knn", "--train-embeddings", str(out), "--test-embeddings", str(out))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and str(out) in lines[0], (shape, err)
