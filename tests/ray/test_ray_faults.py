"""Faults under ``--ray`` (issue 45): a model actor SIGKILLed mid-job is restarted by Ray (``max_restarts`` /
``max_task_retries`` on the pool) and the job's rows are the local job's, each once; a driver SIGKILLed mid-job
leaves an output that ``--resume`` completes, without repeating a row, equal to the local job's file."""

# ruff: noqa: F811  (the fixtures imported from test_ray_jobs are parameters of the tests)
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import run_cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from test_ray_jobs import ckpt, cluster, images  # noqa: E402, F401  (the same cluster, checkpoint and images)

pytestmark = pytest.mark.slow


def slow_source(paths: list[str], marks: Path) -> Any:
    """Image files read slowly (50 ms each), each read marked by a file in ``marks`` (the job's progress, seen
    from the test). Its class is made here, so that Ray's pickling carries it by value to the tasks."""
    from vitkit.data.stream import FileSource

    class Slow(FileSource):
        def load(self, index: int, lazy: bool) -> Any:
            marks.mkdir(exist_ok=True)
            (marks / str(index)).touch()
            time.sleep(0.05)
            return super().load(index, lazy)

    return Slow(paths)


def engine_actor_pids() -> list[int]:
    """The processes of Ray Data's model actors on this machine, by the title Ray gives an actor's worker
    (``ray::_MapWorker...``, the pool's wrapper of :class:`vitkit.ray.EngineActor`; the state API needs the
    dashboard, which these clusters run without)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if line.startswith("ray::") and "MapWorker" in line:
            pids.append(p.pid)
    return pids


def test_an_actor_killed_mid_job_is_restarted_and_every_row_written_once(
    cluster: None, ckpt: Path, images: Path, tmp_path: Path
) -> None:
    from vitkit import ray as vitkit_ray
    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.stream import FileSource, list_inputs
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.outputs.array_reader import read_embeddings

    loaded = load_checkpoint(ckpt)
    marks = tmp_path / "reads"
    source = slow_source(list_inputs([images], skip_bad=True), marks)
    opts = EmbedOptions(batch_size=8, precision="fp32", skip_bad=True, progress=False)
    killed: list[tuple[int, int]] = []  # (pid, images read when it was killed)

    def kill_the_actor() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            read = len(list(marks.iterdir())) if marks.exists() else 0
            pids = engine_actor_pids() if read >= 24 else []
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append((pids[0], read))
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_actor)
    killer.start()
    summary = embed_job(loaded, source, opts, tmp_path / "ray.npy", steps=vitkit_ray.steps(vitkit_ray.RayOptions()))
    killer.join()
    assert killed and killed[0][1] < 64, killed  # killed while images were still being read: mid-job
    assert killed[0][0] not in engine_actor_pids()  # the pool's actor now is a new process
    embed_job(loaded, FileSource(source.paths), opts, tmp_path / "local.npy")
    a, b = read_embeddings(tmp_path / "local.npy"), read_embeddings(tmp_path / "ray.npy")
    assert len(b.ids) == 64 and len(set(b.ids)) == 64 and summary.total == 64
    assert a.ids == b.ids and np.array_equal(a.vectors, b.vectors, equal_nan=True)
    assert (tmp_path / "local.npy").read_bytes() == (tmp_path / "ray.npy").read_bytes()


def test_a_driver_killed_mid_job_resumes_without_repeating_rows(
    capsys: pytest.CaptureFixture[str], ckpt: Path, images: Path, tmp_path: Path
) -> None:
    """``vitkit embed --ray`` in a subprocess (its own local Ray cluster), SIGKILLed once it has written some rows
    through the output store (parts on disk), then rerun with ``--resume``: the local job's file."""
    from vitkit.outputs.array_reader import read_embeddings

    out = tmp_path / "ray.parquet"
    common = ["embed", str(ckpt), str(images), "--precision", "fp32", "--batch-size", "2", "--skip-bad"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-m", "vitkit", *common, "--out", str(out), "--ray"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    parts = out.with_name(out.name + ".parts")
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and driver.poll() is None:
            if parts.is_dir() and len([p for p in parts.iterdir() if p.name.startswith("part-")]) >= 2:
                break
            time.sleep(0.05)
        assert driver.poll() is None, driver.stderr.read().decode() if driver.stderr else ""
        written = len([p for p in parts.iterdir() if p.name.startswith("part-")])
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
        with_group_gone(driver.pid)
    assert not out.exists() and written >= 2  # killed mid-job: rows written, the file not yet assembled
    code, _, err = run_cli(capsys, *common, "--out", str(out), "--ray", "--resume")
    assert code == 0, err
    local = tmp_path / "local.parquet"
    assert run_cli(capsys, *common, "--out", str(local))[0] == 0
    a, b = read_embeddings(local), read_embeddings(out)
    assert len(b.ids) == 64 and len(set(b.ids)) == 64 and a.ids == b.ids
    assert np.array_equal(a.vectors, b.vectors, equal_nan=True)
    assert local.read_bytes() == out.read_bytes()


def with_group_gone(pgid: int) -> None:
    """The killed driver's local Ray cluster (its raylet, workers, GCS: started in the driver's session) ended:
    SIGKILL to that process group, which this test started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
