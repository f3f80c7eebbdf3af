"""The linear head: multinomial logistic regression with L2, against scikit-learn's LogisticRegression on
the same features, and the held-out choice of its strength."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from vitkit.data.subset import stratified_holdout
from vitkit.errors import DataError
from vitkit.train.probe import HELDOUT_SALT, STD_EPS, fit_logistic, fit_probe


def digits(n: int = 500) -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return d.data[:n].astype(np.float64), d.target[:n].astype(np.int64)


def sklearn_head(x: np.ndarray, y: np.ndarray, l2: float) -> LogisticRegression:
    """scikit-learn minimises C sum_i CE_i + ||W||^2 / 2 = C N (mean CE + ||W||^2 / (2 C N)): l2 = 1 / (C N)."""
    return LogisticRegression(C=1.0 / (l2 * len(y)), tol=1e-12, max_iter=20_000).fit(x, y)


@pytest.mark.parametrize("l2", [1e-1, 1e-3])
def test_fit_equals_sklearn_logistic_regression(l2: float) -> None:
    x, y = digits()
    x = (x - x.mean(0)) / (x.std(0) + STD_EPS)
    w, b = fit_logistic(x, y, 10, l2, tol=1e-10)
    ref = sklearn_head(x, y, l2)
    scale = np.abs(ref.coef_).max()
    np.testing.assert_allclose(w.numpy(), ref.coef_, atol=1e-5 * scale)  # coefficients: unique with L2
    proba = torch.softmax(torch.from_numpy(x) @ w.T + b, dim=1).numpy()
    np.testing.assert_allclose(proba, ref.predict_proba(x), atol=1e-6)  # intercepts: up to a shared shift


def test_fit_probe_folds_the_standardisation_into_the_head() -> None:
    x, y = digits()
    x = x * np.linspace(0.5, 3.0, x.shape[1]) + 7.0  # features with offsets and scales of their own
    fit = fit_probe(x, y, 10, l2=1e-2)
    assert fit.l2_mode == "fixed" and fit.weight.shape == (10, 64)
    xs = (x - x.mean(0)) / (x.std(0) + STD_EPS)
    ref = sklearn_head(xs, y, 1e-2)  # the same regularisation on the standardised features
    proba = torch.softmax(torch.from_numpy(fit.logits(x)), dim=1).numpy()  # the head on the raw features
    np.testing.assert_allclose(proba, ref.predict_proba(xs), atol=1e-5)


def test_l2_is_chosen_on_heldout_examples_that_are_never_fitted() -> None:
    x, y = digits(400)
    rng = np.random.default_rng(0)
    noisy = x + rng.normal(0, 1.0, x.shape)  # an "augmented pass": the same examples again
    rows, labels = np.concatenate([x, noisy]), np.concatenate([y, y])
    examples, clean = np.tile(np.arange(400), 2), np.arange(800) < 400
    grid = (1e-3, 1e-1, 10.0)
    fit = fit_probe(rows, labels, 10, examples=examples, clean=clean, grid=grid, seed=3)
    assert fit.l2_mode == "auto" and [h["l2"] for h in fit.heldout] == sorted(grid, reverse=True)
    held = stratified_holdout(y, 10, 0.2, 3, salt=HELDOUT_SALT)
    assert held is not None and fit.heldout_count == held.sum() == sum(round(0.2 * c) for c in np.bincount(y))
    # redo the held-out fits by hand: every pass of a held-out example left out, clean rows scored
    keep = ~np.isin(examples, np.flatnonzero(held))
    m, s = rows.mean(0), rows.std(0) + STD_EPS
    for h in fit.heldout:
        w, b = fit_logistic((rows[keep] - m) / s, labels[keep], 10, h["l2"], tol=1e-9)
        pred = (torch.from_numpy((x[held] - m) / s) @ w.T + b).argmax(1).numpy()
        # at most one example apart: the grid fits stop at a looser gradient tolerance
        assert np.mean(pred == y[held]) == pytest.approx(h["top1"], abs=1.5 / held.sum())
    best = max(fit.heldout, key=lambda h: (h["top1"], -h["loss"], h["l2"]))
    assert fit.l2 == best["l2"]


def test_a_single_example_class_falls_back_to_the_default_l2() -> None:
    x, y = digits(60)
    keep = np.concatenate([np.flatnonzero(y == 0)[:1], np.flatnonzero(y != 0)])
    fit = fit_probe(x[keep], y[keep], 10)
    assert fit.l2_mode == "default" and "single training example" in fit.notes[0]
    with pytest.raises(DataError, match="class 0 has no training example"):
        fit_probe(x[y != 0], y[y != 0], 10)
