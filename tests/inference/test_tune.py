"""The fast path's kernels chosen by measurement (vitkit.inference.tune): the choice logic with timings faked,
so it is tested on any CPU, and each choice computing the model's function."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from vitkit.inference import tune
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.fast import InferenceViT, Kernels
from vitkit.models.vit import VisionTransformer, ViTConfig

REAL_TIMER = tune.default_timer  # taken at import: --cpu-kind replaces the module's with a fake during tests


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Faked timings never reach the user's tuning cache."""
    monkeypatch.setattr(tune, "_cache_file", lambda: tmp_path / "default-tuning.json")


def tiny(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=(32, 32), patch_size=8, hidden_size=64, depth=2, num_heads=4, mlp_dim=128, num_classes=5)
    return VisionTransformer(cfg).eval()


def faked(times: Mapping[str, float], calls: list[list[str]] | None = None) -> tune.Timer:
    """A timer answering ``times`` (ms) for each candidate by name (4.0 ms for names not given)."""

    def timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        if calls is not None:
            calls.append(list(fns))
        return {name: times.get(name, 4.0) for name in fns}

    return timer


def test_built_in_rules_stay_unless_an_alternative_wins_by_min_gain() -> None:
    model = tiny()
    # sdpa 5% faster than the built-in attention: noise, the rule stays; torch LayerNorm 20% faster: it wins
    close = tune.tune_kernels(model, torch.float32, 4, timer=faked({"explicit": 4.0, "sdpa": 3.81}), cache=False)
    assert close.kernels.attention == "explicit" and not close.plain
    far = tune.tune_kernels(model, torch.float32, 4, timer=faked({"explicit": 4.0, "sdpa": 3.0}), cache=False)
    assert far.kernels.attention == "sdpa"
    race = {r.piece: r for r in far.races}
    assert race["attention"].times_ms == {"explicit": 4.0, "sdpa": 3.0} and race["attention"].builtin == "explicit"
    assert "attention=sdpa" in far.summary() and "sdpa 3.00" in far.describe()


def test_the_plain_model_runs_where_it_beats_the_fast_path() -> None:
    model = tiny()
    timer = faked({"fast path": 10.0, "plain model": 8.0})
    runner, tuning = tune.build_fast(model, torch.bfloat16, 4, timer=timer)
    assert tuning.plain and isinstance(runner, tune.PlainModel)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        out = runner(x).float()
        feats = runner.forward_head(runner.forward_features(x), pre_logits=True).float()
        ref_feats = model.forward_head(model.forward_features(x), pre_logits=True)
    assert torch.allclose(out, ref, atol=5e-2, rtol=5e-2)  # the model's function, in bf16
    assert torch.allclose(feats, ref_feats, atol=5e-2, rtol=5e-2)
    # a 5% lead is not enough to leave the fast path
    timer = faked({"fast path": 10.0, "plain model": 9.5})
    runner, tuning = tune.build_fast(model, torch.bfloat16, 4, timer=timer, cache=False)
    assert not tuning.plain and isinstance(runner, InferenceViT)


def test_int8_has_no_plain_race() -> None:
    calls: list[list[str]] = []
    tuning = tune.tune_kernels(tiny(), torch.float32, 4, int8=True, timer=faked({}, calls), cache=False)
    assert not tuning.plain
    assert all("plain model" not in c for c in calls)


@pytest.mark.parametrize(
    "kernels",
    [
        Kernels(attention="sdpa", layernorm="torch", gemm="plain"),
        Kernels(attention="explicit", gemm="packed"),
        Kernels(attention="c", layernorm="c"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_choice_computes_the_models_function(kernels: Kernels, dtype: torch.dtype) -> None:
    model = tiny(1)
    x = torch.randn(4, 3, 32, 32)
    fast = InferenceViT(model, dtype, rows=None, kernels=kernels)
    with torch.no_grad():
        ref = model(x)
        out = fast(x).float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(out, ref, atol=tol, rtol=tol)
    block = fast.blocks[0]
    if kernels.attention == "sdpa":
        assert block.fused is None and not block.explicit_attention
    if kernels.attention == "explicit":
        assert block.fused is None and block.explicit_attention
    if kernels.gemm == "plain":
        assert not block.fc1.packed
    if kernels.layernorm == "torch":
        assert block.norm1.fn is None


def test_kernels_refuse_unknown_choices() -> None:
    with pytest.raises(ValueError, match="attention"):
        Kernels(attention="flash")


def test_a_measurement_is_cached_and_reused(tmp_path: Path) -> None:
    cache = tmp_path / "tuning.json"
    model = tiny()
    calls: list[list[str]] = []
    first = tune.tune_kernels(model, torch.float32, 4, timer=faked({"sdpa": 2.5}, calls), cache=cache)
    assert first.source == "measured" and first.kernels.attention == "sdpa" and calls
    calls.clear()
    again = tune.tune_kernels(model, torch.float32, 4, timer=faked({}, calls), cache=cache)
    assert not calls and again.source == "cached"
    assert again.kernels == first.kernels and again.races == first.races
    # another batch is another measurement
    tune.tune_kernels(model, torch.float32, 8, timer=faked({}, calls), cache=cache)
    assert calls
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize(
    "damage",
    [
        "not json",
        "[1, 2]",
        '{"KEY": {"kernels": {"attention": "rm -rf"}, "plain": false, "races": []}}',
        '{"KEY": {"kernels": {}, "plain": "yes", "races": []}}',
        '{"KEY": {"kernels": {}, "plain": false, "races": [{"piece": "a", "times_ms": {"x": "NaN"}, '
        '"winner": "x", "builtin": "x"}]}}',
    ],
)
def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path: Path, damage: str) -> None:
    model = tiny()
    cache = tmp_path / "tuning.json"
    key = tune.cache_key(model, torch.float32, 4, False)
    cache.write_text(damage.replace("KEY", key))
    calls: list[list[str]] = []
    tuning = tune.tune_kernels(model, torch.float32, 4, timer=faked({}, calls), cache=cache)
    assert calls and tuning.source == "measured"
    assert tune.cached(key, cache) == tune.Tuning(tuning.kernels, tuning.plain, tuning.races, "cached")


def test_a_symlinked_cache_is_not_read(tmp_path: Path) -> None:
    model = tiny()
    real = tmp_path / "elsewhere.json"
    key = tune.cache_key(model, torch.float32, 4, False)
    real.write_text(json.dumps({key: {"kernels": {"attention": "sdpa"}, "plain": True, "races": []}}))
    link = tmp_path / "tuning.json"
    link.symlink_to(real)
    assert tune.cached(key, link) is None


def test_the_key_follows_threads_batch_and_dtype() -> None:
    model = tiny()
    base = tune.cache_key(model, torch.float32, 4, False)
    assert base != tune.cache_key(model, torch.bfloat16, 4, False)
    assert base != tune.cache_key(model, torch.float32, 8, False)
    assert base != tune.cache_key(model, torch.float32, 4, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert base != tune.cache_key(model, torch.float32, 4, False)
    finally:
        torch.set_num_threads(threads)


def test_blocks_too_fast_to_time_keep_the_built_in_rules(tmp_path: Path) -> None:
    cache = tmp_path / "tuning.json"
    tuning = tune.tune_kernels(tiny(), torch.float32, 4, timer=faked({"explicit": 0.5, "sdpa": 0.1}), cache=cache)
    assert tuning.kernels == Kernels() and not tuning.races and "too small" in tuning.source
    assert not cache.exists()  # nothing measured, nothing kept


def test_the_real_timer_races_every_candidate_on_the_block() -> None:
    calls: list[list[str]] = []

    def counting(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        calls.append(list(fns))
        out = REAL_TIMER(fns)
        # above the measurable floor, ranks unchanged; a NaN (the real timer saw the machine busy, as it does under
        # a loaded CI) becomes a finite time so that the race goes on: what is checked is that every candidate ran
        return {k: 5.0 + (1.0 if math.isnan(v) else v) for k, v in out.items()}

    tuning = tune.tune_kernels(tiny(), torch.float32, 2, timer=counting, cache=False)
    assert calls[0][0] == "explicit" and "sdpa" in calls[0]  # the built-in rule first
    assert calls[-1] == ["fast path", "plain model"]
    assert tuning.source == "measured" and {r.piece for r in tuning.races} >= {"attention", "model"}


def test_the_engine_runs_what_the_race_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    from vitkit.checkpoints.preprocess import Preprocess

    model = tiny()
    monkeypatch.setattr(tune, "default_timer", faked({"fast path": 10.0, "plain model": 5.0}))
    monkeypatch.setattr(tune, "_cache_file", lambda: None)
    pre = Preprocess(image_size=(32, 32))
    engine = InferenceEngine(model, pre, precision="bf16", device="cpu", batch_size=4)
    assert isinstance(engine.runner, tune.PlainModel)
    assert "plain model" in engine.describe()
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(engine.logits(x), model(x).detach(), atol=5e-2, rtol=5e-2)
    untuned = InferenceEngine(model, pre, precision="bf16", device="cpu", batch_size=4, tune=False)
    assert isinstance(untuned.runner, InferenceViT) and untuned.tuning == tune.Tuning()


@pytest.mark.parametrize("busy_in", ["attention", "model"])
def test_a_race_on_a_busy_machine_decides_nothing(tmp_path: Path, busy_in: str) -> None:
    """The default timer answers NaN when the process got under MIN_CPU_SHARE of its cores (another process
    slowed one bench's races 4x): the built-in rules stay and nothing is cached."""

    def timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        busy = ("sdpa" in fns) if busy_in == "attention" else ("plain model" in fns)
        return {k: float("nan") if busy else 4.0 for k in fns}

    cache = tmp_path / "tuning.json"
    tuning = tune.tune_kernels(tiny(), torch.float32, 4, timer=timer, cache=cache)
    assert tuning.kernels == Kernels() and not tuning.plain and "busy" in tuning.source
    assert not cache.exists()


def test_the_default_timer_refuses_a_share_of_the_cores_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    from vitkit.timing import Timing

    monkeypatch.setattr(tune, "time_alternating", lambda fns, *a, **k: {n: Timing([0.03], 0.3) for n in fns})
    out = REAL_TIMER({"a": lambda: None, "b": lambda: None})
    assert all(v != v for v in out.values())  # NaN
    monkeypatch.setattr(tune, "time_alternating", lambda fns, *a, **k: {n: Timing([0.03], 0.95) for n in fns})
    assert REAL_TIMER({"a": lambda: None, "b": lambda: None}) == {"a": 30.0, "b": 30.0}
