"""The closed-form few-shot probe against numpy's solvers and on problems with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from vitkit.errors import ConfigError, DataError
from vitkit.evaluate.fewshot import (
    BIAS_CONSTANT,
    FewShotResult,
    RidgeProbe,
    fewshot_evaluate,
    sample_episodes,
)


def augmented(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Standardise with ``ref``'s statistics (population std + 1e-5) and append the bias column."""
    z = (x - ref.mean(axis=0)) / (ref.std(axis=0) + 1e-5)
    return np.hstack([z, np.full((len(x), 1), BIAS_CONSTANT)])


def targets(y: np.ndarray, K: int) -> np.ndarray:
    t = -np.ones((len(y), K))
    t[np.arange(len(y)), y] = 1.0
    return t


@pytest.mark.parametrize(("n", "d"), [(60, 8), (12, 40)])  # primal (N >= D) and dual (D > N) forms
@pytest.mark.parametrize("l2", [1e-2, 1.0, 1024.0])
def test_solution_equals_ridge_regression(n: int, d: int, l2: float) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + 3, rng.integers(0, 4, size=n)
    probe = RidgeProbe(x, y, 4)
    assert probe.primal == (n >= d + 1)
    xa = augmented(x, x)
    want = np.linalg.solve(xa.T @ xa + l2 * np.eye(d + 1), xa.T @ targets(y, 4))
    np.testing.assert_allclose(probe.weights(l2), want, rtol=1e-7, atol=1e-10)
    x_test = rng.normal(size=(7, d))
    np.testing.assert_allclose(probe.scores(x_test, l2), augmented(x_test, x) @ want, rtol=1e-7, atol=1e-9)


def test_vanishing_l2_is_least_squares() -> None:
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(50, 6)), rng.integers(0, 3, size=50)
    probe = RidgeProbe(x, y, 3)
    ls, *_ = np.linalg.lstsq(augmented(x, x), targets(y, 3), rcond=None)
    np.testing.assert_allclose(probe.weights(1e-9), ls, rtol=1e-6, atol=1e-9)


def separable(n_per_class: int, K: int = 5, d: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(K, d)) * 4
    y = np.repeat(np.arange(K), n_per_class)
    return centres[y] + 0.3 * rng.normal(size=(len(y), d)), y


@pytest.mark.parametrize("l2", [1024.0, "auto"])
def test_separable_features_reach_100_percent(l2: float | str) -> None:
    xtr, ytr = separable(40)
    xte, yte = separable(30, seed=1)
    res = fewshot_evaluate(xtr, ytr, xte, yte, 5, shots=(1, 5, 10, 25), seeds=(0, 1, 2), l2=l2)
    assert res.shots == [1, 5, 10, 25] and res.seeds == [0, 1, 2]
    for k in res.shots:
        assert res.accuracy[k] == [1.0, 1.0, 1.0]
        assert res.mean(k) == 1.0 and res.std(k) == 0.0


def test_auto_l2_finds_the_direction_heavy_regularisation_misses() -> None:
    """Class information lives in x1 - x2 while a shared nuisance dominates both features: least squares
    (small l2) separates the classes, a heavily regularised probe (~ nearest class mean) cannot."""
    rng = np.random.default_rng(3)

    def data(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 2, size=n)
        nuisance = rng.normal(size=n) * 10
        x = np.stack([nuisance + (2 * y - 1) * 0.5, nuisance], axis=1)
        return x, y

    xtr, ytr = data(400)
    xte, yte = data(400)
    heavy = fewshot_evaluate(xtr, ytr, xte, yte, 2, shots=(25,), l2=2.0**16)
    auto = fewshot_evaluate(xtr, ytr, xte, yte, 2, shots=(25,), l2="auto", heldout_per_class=50)
    assert heavy.mean(25) < 0.8
    assert auto.mean(25) > 0.97
    assert max(auto.l2[25]) <= 2.0**4  # a weak regularisation was chosen on the held-out examples


def test_episodes_are_nested_balanced_disjoint_and_seeded() -> None:
    y = np.repeat(np.arange(3), [30, 40, 35])
    eps = sample_episodes(y, 3, shots=(1, 5, 10), seeds=(0, 1), heldout_per_class=4)
    by = {(e.seed, e.shots): e for e in eps}
    for seed in (0, 1):
        for k in (1, 5, 10):
            e = by[seed, k]
            assert np.bincount(y[e.train], minlength=3).tolist() == [k, k, k]
            assert not set(e.train) & set(e.heldout)
            assert np.bincount(y[e.heldout], minlength=3).tolist() == [4, 4, 4]
        assert set(by[seed, 1].train) <= set(by[seed, 5].train) <= set(by[seed, 10].train)
    assert not np.array_equal(by[0, 10].train, by[1, 10].train)
    again = sample_episodes(y, 3, shots=(1, 5, 10), seeds=(0, 1), heldout_per_class=4)
    assert all(np.array_equal(a.train, b.train) for a, b in zip(eps, again, strict=True))


def test_too_few_examples_is_a_clear_error() -> None:
    y = np.repeat(np.arange(3), [30, 4, 35])
    with pytest.raises(DataError, match="class 1 has only 4 training examples"):
        sample_episodes(y, 3, shots=(1, 5))
    with pytest.raises(ConfigError, match="positive"):
        sample_episodes(y, 3, shots=(0,))
    with pytest.raises(ConfigError, match="l2"):
        fewshot_evaluate(*separable(5), *separable(5), 5, shots=(1,), l2=-1.0)


def test_result_summary() -> None:
    r = FewShotResult([1], [0, 1, 2], {1: [0.5, 0.6, 0.7]}, {1: [1024.0] * 3})
    assert r.mean(1) == pytest.approx(0.6) and r.std(1) == pytest.approx(0.1)
    assert "2^10" in r.table() and r.to_dict()["shots"]["1"]["per_seed"] == [0.5, 0.6, 0.7]  # type: ignore[index]


def test_the_two_probes_grids_are_one_definition_on_their_losses_scales() -> None:
    """The ridge (2^-6 .. 2^16) and the linear head (1e-6 .. 1) had a grid each, on scales 10^5 apart with nothing
    saying why. One definition now, and the reason tested: the ridge's l2 weighs a sum over rows, the head's a mean,
    so with every row doubled the ridge needs twice its l2 for the same weights and the head the same l2."""
    import torch

    from vitkit.evaluate import fewshot
    from vitkit.train import probe

    assert probe.l2_grid(2.0, -6, 16) == fewshot.L2_GRID and len(fewshot.L2_GRID) == 23
    assert (fewshot.L2_GRID[0], fewshot.L2_GRID[-1]) == (2.0**-6, 2.0**16)
    assert tuple(float(10.0**e) for e in np.arange(-6.0, 0.25, 0.5)) == probe.L2_GRID  # as it always was
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 5)), np.arange(30) % 3
    x2, y2 = np.concatenate([x, x]), np.concatenate([y, y])
    once, twice = RidgeProbe(x, y, 3), RidgeProbe(x2, y2, 3)
    np.testing.assert_allclose(twice.weights(2 * 8.0), once.weights(8.0), rtol=1e-10)
    assert not np.allclose(twice.weights(8.0), once.weights(8.0), rtol=1e-3)
    w, b = probe.fit_logistic(x, y, 3, 0.01)
    w2, b2 = probe.fit_logistic(x2, y2, 3, 0.01)
    torch.testing.assert_close((w2, b2), (w, b), atol=1e-6, rtol=1e-5)
