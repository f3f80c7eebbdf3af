"""``vitkit bench --compare onnxruntime openvino``: the engines run vitkit's own ONNX export of the benchmarked
model (same function in fp32), alternate with vitkit's runners, and get a ratio each."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import SRC
from vitkit.bench.harness import BenchSpec, run_bench
from vitkit.errors import ConfigError
from vitkit.inference.backends import engine_available
from vitkit.timing import time_alternating

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def test_engine_peers_compute_the_model_and_get_ratios(tmp_path: Path) -> None:
    """Through the CLI in a child process: once OpenVINO's thread pool and scikit-learn's pyarrow are loaded, a
    later fork (DataLoader workers in other tests) can crash, so the engines stay out of the test process."""
    compare = ["onnxruntime", "openvino"] if engine_available("openvino") else ["onnxruntime"]
    out = tmp_path / "bench.json"
    argv = ["bench", "Ti/16", "--image-size", "32", "--batch-size", "2", "--precision", "fp32", "int8"]
    argv += ["--repeats", "2", "--no-latency", "--json", str(out), "--compare", *compare]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "vitkit", *argv], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["runner"]: r for r in result["results"]}
    expected = {"onnxruntime [fp32]", "onnxruntime [int8]"}
    if "openvino" in compare:
        expected |= {"openvino [fp32]", "openvino [int8]"}
        assert rows["openvino [int8]"]["engine"].startswith("OpenVINO") and "NNCF" in rows["openvino [int8]"]["engine"]
    assert expected <= set(rows)
    for name in expected:
        assert len(rows[name]["timing"]["times_s"]) == 2
    for name in ("onnxruntime [fp32]", "openvino [fp32]"):
        if name in rows:  # the export runs the same function as the PyTorch model
            assert rows[name]["agreement_vs_fp32"]["rel_err"] < 1e-5
    assert 1e-3 < rows["onnxruntime [int8]"]["agreement_vs_fp32"]["rel_err"] < 0.15  # really quantised
    fast = rows["vitkit-fast [int8]"]
    assert fast["speedup_vs_peers"]["onnxruntime [int8]"] == pytest.approx(
        fast["img_per_s"] / rows["onnxruntime [int8]"]["img_per_s"]
    )
    assert "onnxruntime" in result["machine"]
    assert "vitkit-fast [int8]: " in proc.stdout and "onnxruntime [int8]" in proc.stdout
    assert "Statistics collection" not in proc.stdout + proc.stderr  # NNCF's progress bars are kept quiet


def test_engine_peers_are_for_cpu_inference() -> None:
    with pytest.raises(ConfigError, match="inference peers on the CPU"):
        run_bench(BenchSpec(task="train", precisions=("fp32",), compare=("onnxruntime",)))


def test_settle_leaves_idle_time_before_each_timed_call() -> None:
    calls: list[float] = []
    timings = time_alternating(
        {"a": lambda: calls.append(time.perf_counter()), "b": lambda: calls.append(time.perf_counter())},
        repeats=2,
        device=torch.device("cpu"),
        threads=1,
        settle_s=0.02,
    )
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(calls) == 4 and min(gaps) >= 0.02
    assert max(timings["a"].times) < 0.02  # the pause is not part of the timed call
