"""benchmarks/gpu_report.py (issue 27's table) where there is no GPU: it says so in its JSON and exits 0, a
missing peer's rows say so, and the whole report runs on the CPU at a tiny size (the code, not the figures)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from helpers import SRC

SCRIPT = SRC.parent / "benchmarks" / "gpu_report.py"


@pytest.fixture(scope="module")
def report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the report would measure it")
def test_without_cuda_it_writes_a_json_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        env={"PYTHONPATH": str(SRC), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["skipped"].startswith("no CUDA device") and "rows" not in result
    assert set(result["peers"]) == {"vitkit", "timm", "transformers"}
    assert proc.stdout.startswith("Not measured: no CUDA device")


def test_missing_peers_are_named(report: ModuleType) -> None:
    status = report.peer_status(lambda name: None if name == "timm" else object())
    assert status == {"vitkit": None, "timm": "timm is not installed", "transformers": None}


def test_the_report_runs_on_the_cpu_with_a_peer_missing(report: ModuleType) -> None:
    """--device cpu --quick --no-compile: every row of the table, the fast path's, the ratios and the
    correctness checks, with timm reported missing (whether or not it is installed here)."""
    args = report.parse_args(["--device", "cpu", "--quick", "--no-compile", "--repeats", "1", "--no-fp8"])
    status = {"vitkit": None, "timm": "timm is not installed", "transformers": None}
    result = report.run(args, status)
    rows = result["rows"]
    assert {(r["peer"], r["task"]) for r in rows} == {
        *((p, t) for p in ("vitkit", "timm", "transformers") for t in ("inference", "train")),
        ("vitkit engine", "inference"),
    }
    for r in rows:
        if r["peer"] == "timm":
            assert r["missing"] == "timm is not installed" and "img_per_s" not in r
        else:
            assert r["img_per_s"] > 0 and r["peak_fraction"] > 0 and "vs_timm" not in r  # no timm to divide by
    c = result["correctness"]
    assert c["fp32_vs_cpu_rel_err"] < 1e-6 and c["official_fixture_rel_err"] < 1e-5  # the CPU against itself
    assert 0 < c["bf16_vs_cpu_rel_err"] < 3e-2
    table = report.markdown(result)
    assert "| Ti/16 | train b4 | eager | timm | - (timm is not installed) | - | - |" in table
    assert table.count("\n| Ti/16 |") == 7


def test_ratios_against_timm(report: ModuleType) -> None:
    """vitkit / timm per (model, task, mode), and the fraction of the peak (a training step = 3 forwards)."""
    rows = [
        {"model": "B/16", "task": "train", "compiled": True, "peer": "vitkit", "img_per_s": 300.0},
        {"model": "B/16", "task": "train", "compiled": True, "peer": "timm", "img_per_s": 250.0},
        {"model": "B/16", "task": "train", "compiled": False, "peer": "vitkit", "img_per_s": 200.0},
        {"model": "B/16", "task": "train", "compiled": False, "peer": "timm", "missing": "timm is not installed"},
    ]
    report.add_ratios(rows, 1e15, {"B/16": 35e9})
    assert rows[0]["vs_timm"] == pytest.approx(1.2) and "vs_timm" not in rows[1] and "vs_timm" not in rows[2]
    assert rows[0]["peak_fraction"] == pytest.approx(300 * 3 * 35e9 / 1e15)


def test_a_budget_leaves_out_what_it_cannot_start(report: ModuleType) -> None:
    """--budget 0: nothing is measured after the first check of the clock, and every left-out row says why."""
    args = report.parse_args(["--device", "cpu", "--quick", "--no-compile", "--repeats", "1", "--budget", "0"])
    status = {"vitkit": None, "timm": "timm is not installed", "transformers": None}
    rows = report.run(args, status)["rows"]
    assert rows and all(r["missing"] == "not run: over --budget 0 s" for r in rows)
    assert {(r["task"], r["compiled"]) for r in rows} == {
        ("inference", False),
        ("train", False),
        ("inference", True),
        ("inference fp8", False),
    }
    assert "not run: over --budget" in report.markdown({"rows": rows})


def test_the_fp8_rows(report: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fp8 cannot run, one row says why; where it can (faked here: PyTorch runs _scaled_mm on the CPU too),
    fp8 against the bf16 fast path, with top-1 agreement with fp32 on the real images."""
    from vitkit.inference import fp8

    args = report.parse_args(["--device", "cpu", "--quick", "--no-compile", "--repeats", "1", "--only-fp8"])
    status = {"vitkit": None, "timm": "timm is not installed", "transformers": None}
    (row,) = report.run(args, status)["rows"]
    assert row["peer"] == "vitkit fp8" and row["missing"].startswith("fp8 needs a CUDA GPU")
    monkeypatch.setattr(fp8, "fp8_unsupported", lambda device: None)
    rows = report.run(args, status)["rows"]
    assert [r["peer"] for r in rows] == ["vitkit bf16 fast path", "vitkit fp8"]
    assert all(r["img_per_s"] > 0 and 0 <= r["top1_agreement_fp32"] <= 1 for r in rows)
    assert rows[1]["vs_bf16_fast_path"] == pytest.approx(rows[1]["img_per_s"] / rows[0]["img_per_s"])
    assert "x bf16 fast path | " in report.markdown({"rows": rows})
