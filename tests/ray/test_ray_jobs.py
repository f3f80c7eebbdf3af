"""``vitkit embed --ray`` and ``vitkit predict --ray`` (vitkit.ray) against the local job: on a Ray cluster of this
machine (``ray.init(num_cpus=2)``) the same rows -- ids, vectors, labels, failed rows with their reasons -- and
the same output files; a decoding task that raises is retried."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from helpers import run_cli, tiny_checkpoint

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

CLASSES = ["cat", "dog", "ship", "tree"]
pytestmark = pytest.mark.slow  # a Ray cluster starts in ~10 s


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), CLASSES)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 files: 60 tiny PNGs and JPEGs of assorted sizes, a truncated JPEG, an empty file, text named .png and a
    JPEG marker followed by nothing of a JPEG."""
    root = tmp_path_factory.mktemp("in")
    rng = np.random.default_rng(0)
    for i in range(60):
        w, h = int(rng.integers(8, 40)), int(rng.integers(8, 40))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i:02d}.{'png' if i % 2 else 'jpg'}")
    (root / "30b.jpg").write_bytes((root / "30.jpg").read_bytes()[:40])  # truncated
    (root / "41b.png").write_bytes(b"")
    (root / "52b.png").write_text("not an image")
    (root / "07b.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    return root


def test_embed_on_ray_writes_the_local_jobs_rows(
    capsys: pytest.CaptureFixture[str], cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    from vitkit.outputs.array_reader import read_embeddings

    common = ["embed", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8", "--skip-bad"]
    local, on_ray = tmp_path / "local.parquet", tmp_path / "ray.parquet"
    code, _, err = run_cli(capsys, *common, "--workers", "1", "--out", str(local))
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--out", str(on_ray), "--ray", "--actors", "1")
    assert code == 0, err
    assert "note: 4 of 64 image(s) failed" in err
    a, b = read_embeddings(local), read_embeddings(on_ray)
    assert a.ids == b.ids and len(a.ids) == 64
    assert np.array_equal(a.index, b.index) and np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.vectors, b.vectors, equal_nan=True)  # the failed rows NaN in both
    assert np.isnan(b.vectors).all(axis=1).sum() == 4 and a.meta == b.meta
    assert local.read_bytes() == on_ray.read_bytes()  # the same file, byte for byte


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_on_ray_writes_the_local_jobs_rows(
    capsys: pytest.CaptureFixture[str], cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    common = ["predict", "-c", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8", "--skip-bad",
              "--top-k", "2", "--logits"]  # fmt: skip
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    code, _, err = run_cli(capsys, *common, "--workers", "0", "--out", str(local))
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--out", str(on_ray), "--ray")
    assert code == 0, err
    rows, got = read_jsonl(local), read_jsonl(on_ray)
    assert len(rows) == 64 and rows == got  # ids, labels, probabilities, logits and errors
    failed = {r["image"]: r["error"] for r in got if r["error"]}
    assert sorted(Path(p).name for p in failed) == ["07b.jpg", "30b.jpg", "41b.png", "52b.png"]
    assert "empty file" in failed[str(images / "41b.png")]
    assert local.read_bytes() == on_ray.read_bytes()
    assert Path(f"{local}.vitkit.json").read_text() == Path(f"{on_ray}.vitkit.json").read_text()


def test_actors_that_leave_no_cpu_to_decode_on_are_one_line(
    capsys: pytest.CaptureFixture[str], cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    argv = ["embed", str(ckpt), str(images), "--out", str(tmp_path / "o.npy"), "--ray", "--actors", "2"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "would leave none to decode on" in err and "Traceback" not in err


def test_without_skip_bad_the_first_bad_image_stops_the_job_as_locally(
    capsys: pytest.CaptureFixture[str], cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    common = ["predict", "-c", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "8"]
    code, _, err_local = run_cli(capsys, *common, "--out", str(tmp_path / "l.jsonl"))
    code_ray, _, err_ray = run_cli(capsys, *common, "--out", str(tmp_path / "r.jsonl"), "--ray")
    assert code == code_ray == 2
    last = [ln for ln in err_ray.splitlines() if "07b.jpg" in ln]
    assert last and last[-1] in err_local and "Traceback" not in err_ray
    assert (tmp_path / "l.jsonl").read_bytes() == (tmp_path / "r.jsonl").read_bytes()  # the batches before it


def test_a_decoding_task_that_raises_is_retried(cluster: None, ckpt: Path, images: Path, tmp_path: Path) -> None:
    """The first try of every decoding task raises (an OSError, as a network file system gives); Ray runs it again
    and the job's rows are those of a run without faults."""
    from vitkit import ray as vitkit_ray
    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.stream import FileSource, list_inputs
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.outputs.array_reader import read_embeddings
    from vitkit.ray import RayOptions

    loaded = load_checkpoint(ckpt)
    source = flaky_source(list_inputs([images], skip_bad=True), tmp_path / "tries")
    opts = EmbedOptions(batch_size=16, precision="fp32", skip_bad=True, progress=False)
    on_ray = RayOptions(retries=2, actors=2, cpus_per_actor=0.5)  # two actors on the two CPUs, one to decode
    embed_job(loaded, source, opts, tmp_path / "flaky.npy", steps=vitkit_ray.steps(on_ray))
    embed_job(loaded, FileSource(source.paths), opts, tmp_path / "plain.npy")
    assert len(list((tmp_path / "tries").iterdir())) == 4  # one failed try per batch of 16
    a, b = read_embeddings(tmp_path / "flaky.npy"), read_embeddings(tmp_path / "plain.npy")
    assert a.ids == b.ids and np.array_equal(a.vectors, b.vectors, equal_nan=True)


def flaky_source(paths: list[str], tries: Path) -> Any:
    """Image files whose first read of each batch's first item raises OSError (marked by a file in ``tries``).
    Its class is made here, so that Ray's pickling carries it by value to the tasks."""
    from vitkit.data.stream import FileSource

    class Flaky(FileSource):
        def load(self, index: int, lazy: bool) -> Any:
            mark = tries / str(index)
            if index % 16 == 0 and not mark.exists():
                tries.mkdir(exist_ok=True)
                mark.touch()
                raise OSError(f"{self.paths[index]}: stale file handle")
            return super().load(index, lazy)

    return Flaky(paths)
