"""The engine's plan is made once per job (issue 42, "plan once"): from the request and the machine, before anything
is decoded; the job's transform, its workers and its engine read that one plan, and what building measured (the
kernel races of vitkit.inference.tune) is recorded on the plan the engine describes."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import tiny_checkpoint
from vitkit.data.stream import FileSource, list_inputs
from vitkit.inference import jobs, policy, tune
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.tune import PlainModel

engine_module: Any = importlib.import_module("vitkit.inference.engine")
predict_module: Any = importlib.import_module("vitkit.inference.predict")
CLASSES = ["cat", "dog", "ship"]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``plan_engine`` counted wherever it is called from, and the one measurement ``auto`` takes
    (``bf16_is_faster``); the fp32 fast path paying and bf16 not faster, so ``auto`` plans the fp32 fast path."""
    calls = {"plan_engine": 0, "bf16_is_faster": 0}
    real = policy.plan_engine

    def plan_engine(*a: Any, **k: Any) -> policy.EnginePlan:
        calls["plan_engine"] += 1
        return real(*a, **k)

    def bf16_is_faster(*a: Any, **k: Any) -> bool:
        calls["bf16_is_faster"] += 1
        return False

    for module in (policy, jobs, engine_module):
        monkeypatch.setattr(module, "plan_engine", plan_engine)
    monkeypatch.setattr(policy, "bf16_is_faster", bf16_is_faster)
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": True)
    return calls


@pytest.fixture
def plain_wins(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernel races timed by a clock on which the plain model is 10x faster than the fast path and every
    kernel option ties (the built-in rules kept); no tuning cache read or written. Returns the pieces raced."""
    raced: list[str] = []

    def timer(fns: Any) -> dict[str, float]:
        raced.extend(fns)
        return {k: 1.0 if k == "plain model" else 10.0 for k in fns}

    monkeypatch.setattr(tune, "default_timer", timer)
    monkeypatch.setattr(tune, "_cache_file", lambda: None)
    return raced


def jpegs(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=90)
    return list_inputs([folder])


def test_a_predict_job_plans_once_and_describes_what_the_races_chose(
    tmp_path: Path, counted: dict[str, int], plain_wins: list[str]
) -> None:
    loaded = vitkit.load_checkpoint(tiny_checkpoint(tmp_path, CLASSES))
    built: list[InferenceEngine] = []
    opts = predict_module.PredictOptions(batch_size=2, precision="auto", workers=1, progress=False, decode="cpu")
    summary = predict_module.predict_job(
        loaded, FileSource(jpegs(tmp_path / "in", 5)), opts, out=tmp_path / "p.jsonl", on_engine=built.append
    )
    assert summary.written == 5
    assert counted == {"plan_engine": 1, "bf16_is_faster": 1}  # one plan, one measurement, for the whole job
    assert "plain model" in plain_wins  # the races ran, as part of building the plan's engine
    engine = built[0]
    assert isinstance(engine.runner, PlainModel)  # the races turned "fast" into the plain model...
    assert engine.plan.plain_model and engine.plan.path == "fast" and engine.plan.precision == "fp32"
    assert "the plain model (measured faster than the fast path; measured)" in (summary.engine or "")  # ...said so
    assert summary.engine == engine.describe() and summary.engine.startswith("--precision auto -> fp32; fp32, ")


def test_the_python_api_and_an_engine_spec_plan_once(
    tmp_path: Path, counted: dict[str, int], plain_wins: list[str]
) -> None:
    ckpt = tiny_checkpoint(tmp_path, CLASSES)
    files = jpegs(tmp_path / "in", 3)
    got = vitkit.predict(ckpt, files, precision="auto", batch_size=2, top_k=1)
    assert len(got) == 3 and counted == {"plan_engine": 1, "bf16_is_faster": 1}
    loaded = vitkit.load_checkpoint(ckpt)
    spec = jobs.EngineSpec.of(loaded, precision="auto")
    assert counted["plan_engine"] == 2  # planned when the spec is made: a bad request fails there
    engine = spec.build(4, None)
    again = jobs.EngineSpec.of_engine(engine)
    assert again.plan is engine.plan and again.build(4, None) is engine and counted["plan_engine"] == 2
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(engine.logits(x), loaded.model(x), rtol=1e-5, atol=1e-5)  # the plain model in fp32


def test_the_plan_records_the_tuned_kernels_and_the_plain_paths_say_nothing_was_raced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain_wins: list[str]
) -> None:
    model = vitkit.load_checkpoint(tiny_checkpoint(tmp_path, CLASSES))
    monkeypatch.setattr(tune, "default_timer", lambda fns: {k: 10.0 if k == "fast path" else 30.0 for k in fns})
    plan = policy.plan_engine("fp32", fp32_reference=False)
    fast = InferenceEngine.from_loaded(model, plan=plan, batch_size=4)
    assert not fast.plan.plain_model and fast.plan.kernels is not None and "built-in kernels won" in fast.plan.kernels
    assert fast.describe().startswith(f"fp32 fast path ({fast.plan.kernels}) on cpu")
    assert (fast.plan.path, fast.plan.precision) == (plan.path, plan.precision)  # the plan it was given, filled in
    ref = InferenceEngine.from_loaded(model, precision="fp32")
    assert ref.plan.kernels is None and ref.describe() == "fp32 reference (the checkpoint's own model) on cpu"
