"""The paper's few-shot linear evaluation: closed-form regularised least squares on frozen features.

Semantics follow big_vision's ``evaluators/fewshot_lsr.py`` (the evaluator behind the paper's few-shot
numbers):

- k examples of every class are drawn from the training split with ``numpy.random.default_rng(seed)``: one
  permutation per class, the first k taken, so the shot sets of one seed are nested (1 in 5 in 10 in 25);
- features are standardised with the mean and standard deviation (+1e-5) of those k*K training features;
- a constant column of 100 is appended as the bias, large so the bias is almost unregularised;
- targets are one-hot vectors rescaled to {-1, 1}^K;
- W = argmin ||X W - Y||^2 + l2 ||W||^2 in closed form, through an eigendecomposition of the smaller Gram
  matrix: X^T X (primal, when N >= D) or X X^T (dual), so every l2 costs one matrix product;
- the prediction is argmax(x W); accuracy is measured on the whole test split.

``l2`` is either fixed (big_vision's default 2^10) or ``"auto"``: chosen from a grid by accuracy on
held-out training examples of every class that are not among the shots.

The drivers behind ``vitkit fewshot`` are here too: :func:`fewshot_dataset` (a model's features of two splits,
through one :class:`~vitkit.inference.features.FeatureProvider`) and :func:`fewshot_embeddings` (two outputs of
``vitkit embed``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, DataError
from vitkit.evaluate.knn import comparable_embeddings
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.features import EXTRACT_DEFAULTS, Extracted, ExtractOptions, FeatureProvider, is_map_style
from vitkit.inference.jobs import EngineSpec
from vitkit.models.vit import VisionTransformer

STD_EPS = 1e-5  # added to the standard deviation: this ridge and the linear head of ``vitkit.train.probe``


def l2_grid(base: float, low: float, high: float, step: float = 1.0) -> tuple[float, ...]:
    """The one definition of a regularisation grid: ``base ** e`` for ``e`` from ``low`` to ``high`` by ``step``.
    Each probe's grid is on the scale of its loss: the few-shot ridge's ``l2`` weighs a sum over rows
    (:data:`L2_GRID`, big_vision's 2^-6 .. 2^16), the linear head's (:data:`vitkit.train.probe.L2_GRID`) a mean
    over rows, so the one strength is not the other's: with every row doubled the ridge needs twice its l2, the
    head the same. It lives here, and ``train/`` imports it: ``evaluate/`` imports nothing of ``train/``."""
    return tuple(float(base**e) for e in np.arange(low, high + step / 2, step))


BIAS_CONSTANT = 100.0
DEFAULT_L2 = 2.0**10
L2_GRID = l2_grid(2.0, -6, 16)  # 2^-6 .. 2^16, for the whole problem (the loss is a sum over rows)
DEFAULT_SHOTS = (1, 5, 10, 25)


class RidgeProbe:
    """L2-regularised least squares from standardised features (+ bias) to {-1, 1}^K targets.

    The eigendecomposition is computed once; ``weights(l2)`` and ``predict(x, l2)`` are then cheap for any
    regularisation strength. All arithmetic is float64.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, num_classes: int) -> None:
        x = np.asarray(x, dtype=np.float64)  # (N, D)
        y = np.asarray(y, dtype=np.int64)  # (N,)
        if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
            raise ValueError(f"expected features (N, D) and labels (N,), got {x.shape} and {y.shape}")
        self.num_classes = num_classes
        self.mean = x.mean(axis=0, keepdims=True)  # (1, D)
        self.std = x.std(axis=0, keepdims=True) + STD_EPS  # (1, D), population std as jnp.std
        xa = self.transform(x)  # (N, D+1)
        targets = 2.0 * np.eye(num_classes)[y] - 1.0  # (N, K) in {-1, 1}
        n, d = xa.shape
        self.primal = n >= d
        if self.primal:  # W = (X^T X + l2 I)^-1 X^T Y = q diag(1/(e+l2)) q^T X^T Y
            eigs, q = np.linalg.eigh(xa.T @ xa)  # (D+1,), (D+1, D+1)
            self._lhs, self._rhs = q, q.T @ (xa.T @ targets)
        else:  # W = X^T (X X^T + l2 I)^-1 Y = X^T q diag(1/(e+l2)) q^T Y
            eigs, q = np.linalg.eigh(xa @ xa.T)  # (N,), (N, N)
            self._lhs, self._rhs = xa.T @ q, q.T @ targets
        self._eigs = eigs

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Standardise with the training statistics and append the bias column: (N, D) -> (N, D+1)."""
        x = (np.asarray(x, dtype=np.float64) - self.mean) / self.std
        return np.concatenate([x, np.full((len(x), 1), BIAS_CONSTANT)], axis=1)

    def weights(self, l2: float) -> np.ndarray:
        """(D+1, K) solution for regularisation strength ``l2`` (> 0); the last row acts on the bias."""
        if not l2 > 0:
            raise ValueError(f"l2 must be positive, got {l2}")
        scale = 1.0 / (self._eigs + l2)  # (M,)
        return (self._lhs * scale[None, :]) @ self._rhs

    def scores(self, x: np.ndarray, l2: float) -> np.ndarray:
        return self.transform(x) @ self.weights(l2)  # (N, K)

    def predict(self, x: np.ndarray, l2: float) -> np.ndarray:
        return self.scores(x, l2).argmax(axis=1)

    def accuracy(self, x: np.ndarray, y: np.ndarray, l2: float) -> float:
        return float((self.predict(x, l2) == np.asarray(y)).mean())


@dataclass(frozen=True)
class Episode:
    """One few-shot problem: the training examples (positions in the training arrays) for one seed."""

    seed: int
    shots: int
    train: np.ndarray  # (shots * K,)
    heldout: np.ndarray  # (<= heldout_per_class * K,), empty unless l2 is chosen on held-out data


def sample_episodes(
    labels: np.ndarray,
    num_classes: int,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    heldout_per_class: int = 0,
) -> list[Episode]:
    """Draw the k-shot training sets (and optional held-out sets) of every seed.

    Per seed and class, one permutation of that class's examples: the first k are the k-shot set, so shot
    sets are nested; held-out examples come right after the largest shot count, so they never overlap
    any shot set of that seed.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if not shots or min(shots) <= 0:
        raise ConfigError(f"shots must be positive integers, got {list(shots)}")
    kmax = max(shots)
    counts = np.bincount(labels, minlength=num_classes)
    need = kmax + (1 if heldout_per_class > 0 else 0)
    short = [c for c in range(num_classes) if counts[c] < need]
    if short:
        c = short[0]
        what = f"{kmax} shots" + (" plus held-out examples to choose l2" if heldout_per_class > 0 else "")
        raise DataError(
            f"class {c} has only {counts[c]} training examples, too few for {what} "
            f"({len(short)} class(es) short); lower the shots or use a fixed --l2"
        )
    episodes = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        held = np.concatenate([p[kmax : kmax + heldout_per_class] for p in perms]).astype(np.int64)
        for k in shots:
            train = np.concatenate([p[:k] for p in perms]).astype(np.int64)
            episodes.append(Episode(int(seed), int(k), train, held))
    return episodes


@dataclass
class FewShotResult:
    """Test accuracy of every (shots, seed) episode and the l2 used."""

    shots: list[int]
    seeds: list[int]
    accuracy: dict[int, list[float]] = field(default_factory=dict)  # shots -> one value per seed
    l2: dict[int, list[float]] = field(default_factory=dict)  # shots -> l2 used per seed
    l2_mode: str = "fixed"
    notes: list[str] = field(default_factory=list)  # e.g. images left out that did not decode (skip_bad)

    def mean(self, shots: int) -> float:
        return float(np.mean(self.accuracy[shots]))

    def std(self, shots: int) -> float:
        """Sample standard deviation over seeds (0 for a single seed)."""
        vals = self.accuracy[shots]
        return float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {  # the notes go to stderr
            "l2_mode": self.l2_mode,
            "seeds": self.seeds,
            "shots": {
                str(k): {"mean": self.mean(k), "std": self.std(k), "per_seed": self.accuracy[k], "l2": self.l2[k]}
                for k in self.shots
            },
        }

    def table(self) -> str:
        lines = [f"{'shots':>6}  {'accuracy':>9}  {'std':>6}  seeds  l2"]
        for k in self.shots:
            l2_txt = ", ".join(_fmt_l2(v) for v in sorted(set(self.l2[k])))
            lines.append(f"{k:>6}  {self.mean(k):>9.2%}  {self.std(k):>6.2%}  {len(self.seeds):>5}  {l2_txt}")
        return "\n".join(lines)


def _fmt_l2(v: float) -> str:
    e = math.log2(v)
    return f"2^{int(e)}" if e == int(e) else f"{v:g}"


def choose_l2(probe: RidgeProbe, x_val: np.ndarray, y_val: np.ndarray, grid: Sequence[float]) -> float:
    """The l2 of ``grid`` with the best held-out accuracy; ties go to the strongest regularisation."""
    best_acc, best_l2 = -1.0, grid[0]
    for l2 in sorted(grid):
        acc = probe.accuracy(x_val, y_val, l2)
        if acc >= best_acc:
            best_acc, best_l2 = acc, l2
    return best_l2


def run_episodes(
    episodes: Sequence[Episode],
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    l2: float | str = DEFAULT_L2,
    l2_grid: Sequence[float] = L2_GRID,
) -> FewShotResult:
    """Fit a probe per episode (``train_x`` rows addressed by the episodes' positions), test on the test set."""
    auto = l2 == "auto"
    if not auto and not (isinstance(l2, int | float) and l2 > 0):
        raise ConfigError(f"l2 must be a positive number or 'auto', got {l2!r}")
    shots = sorted({e.shots for e in episodes})
    seeds = sorted({e.seed for e in episodes})
    result = FewShotResult(shots, seeds, l2_mode="auto" if auto else "fixed")
    for ep in sorted(episodes, key=lambda e: (e.shots, e.seed)):
        probe = RidgeProbe(train_x[ep.train], train_y[ep.train], num_classes)
        if auto:
            if len(ep.heldout) == 0:
                raise ConfigError("l2='auto' needs held-out examples (heldout_per_class > 0)")
            lam = choose_l2(probe, train_x[ep.heldout], train_y[ep.heldout], l2_grid)
        else:
            lam = float(l2)
        result.accuracy.setdefault(ep.shots, []).append(probe.accuracy(test_x, test_y, lam))
        result.l2.setdefault(ep.shots, []).append(lam)
    return result


def fewshot_evaluate(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2: float | str = DEFAULT_L2,
    heldout_per_class: int = 10,
    l2_grid: Sequence[float] = L2_GRID,
) -> FewShotResult:
    """Few-shot linear evaluation on precomputed features: sample episodes, fit, test (see module doc)."""
    episodes = sample_episodes(train_y, num_classes, shots, seeds, heldout_per_class if l2 == "auto" else 0)
    return run_episodes(episodes, train_x, train_y, test_x, test_y, num_classes, l2, l2_grid)


def dataset_labels(dataset: Any) -> np.ndarray | None:
    """All labels without decoding images, when the dataset exposes them (``labels`` / ``targets``)."""
    if not is_map_style(dataset):
        return None
    for attr in ("labels", "targets"):
        labels = getattr(dataset, attr, None)
        if labels is not None and len(labels) == len(dataset):
            return np.asarray(labels, dtype=np.int64)
    return None


def fewshot_dataset(
    model: VisionTransformer | InferenceEngine | EngineSpec,
    train: Any,
    test: Any,
    preprocess: Preprocess,
    *,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2: float | str = DEFAULT_L2,
    heldout_per_class: int = 10,
    l2_grid: Sequence[float] = L2_GRID,
    opts: ExtractOptions = EXTRACT_DEFAULTS,
) -> FewShotResult:
    """Few-shot linear evaluation of a frozen model: features of the training split's sampled shots and of
    the whole test split, then the closed-form probe (module docstring).

    When the training dataset exposes its labels, only the sampled examples are run through the model (a shot
    that does not decode, with ``opts.skip_bad``, is left out and the shots are drawn again without it).
    ``model``: a model, run in ``opts.precision`` (default ``fp32``: the model itself; ``opts.on_engine`` is
    called with the engine once built, after the episodes are drawn), or an engine already built, or the spec of
    one (:func:`~vitkit.inference.jobs.engine_spec`); one engine for both splits.
    """
    K = len(train.classes)
    if len(test.classes) != K:
        raise DataError(f"the training split has {K} classes but the test split has {len(test.classes)}")
    held = heldout_per_class if l2 == "auto" else 0
    features = FeatureProvider(model, preprocess, opts)
    labels = dataset_labels(train)
    if labels is not None:  # sample first, then extract only what the episodes use
        tr, episodes, notes = _shot_features(features, train, labels, K, shots, seeds, held)
    else:
        tr = features.extract(train, logits=False, features=True, desc="features (train)")
        episodes, notes = sample_episodes(tr.labels, K, shots, seeds, held), tr.notes
    te = features.extract(test, logits=False, features=True, desc="features (test)")
    assert tr.features is not None and te.features is not None
    result = run_episodes(episodes, tr.features, tr.labels, te.features, te.labels, K, l2, l2_grid)
    result.notes = [*notes, *te.notes]
    return result


def _shot_features(
    features: FeatureProvider,
    train: Any,
    labels: np.ndarray,
    num_classes: int,
    shots: Sequence[int],
    seeds: Sequence[int],
    held: int,
) -> tuple[Extracted, list[Episode], list[str]]:
    """The features of the examples the episodes use, and the episodes (addressing those features' rows). The
    episodes are drawn from the examples not known to fail; when a drawn one fails to decode (``skip_bad``) it is
    left out and they are drawn again (with no failure: the one draw of every example's labels)."""
    bad = np.zeros(len(labels), dtype=bool)
    while True:
        avail = np.flatnonzero(~bad)
        episodes = sample_episodes(labels[avail], num_classes, shots, seeds, held)
        needed = avail[np.unique(np.concatenate([np.concatenate([e.train, e.heldout]) for e in episodes]))]
        tr = features.extract(train, logits=False, features=True, indices=needed.tolist(),
                              desc="features (train shots)")  # fmt: skip
        if not tr.failed:
            break
        bad[tr.failed] = True
    notes = [] if not bad.any() else [
        f"features (train shots): {int(bad.sum())} drawn image(s) did not decode; left out, the shots drawn again"
    ]  # fmt: skip
    pos = np.full(len(labels), -1, dtype=np.int64)
    pos[tr.indices] = np.arange(len(tr.indices))
    rows = [dataclasses.replace(e, train=pos[avail[e.train]], heldout=pos[avail[e.heldout]]) for e in episodes]
    return tr, rows, notes


def fewshot_embeddings(
    train: str | os.PathLike[str],
    test: str | os.PathLike[str],
    *,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2: float | str = DEFAULT_L2,
    heldout_per_class: int = 10,
    l2_grid: Sequence[float] = L2_GRID,
) -> FewShotResult:
    """:func:`fewshot_dataset` on cached features: two outputs of ``vitkit embed`` (the training split's and the
    test split's, of a labelled dataset) instead of a model's forward passes. The episodes are drawn from the
    training file's labels exactly as from the dataset's, so the same features give the same result."""
    tr, te, K = comparable_embeddings(train, test)
    if not (np.array_equal(tr.index, np.arange(len(tr))) and np.array_equal(te.index, np.arange(len(te)))):
        raise DataError(f"{train} or {test}: not a whole split in order (the episodes address examples by position)")
    x_tr = np.asarray(tr.vectors, dtype=np.float32).reshape(len(tr), -1)
    x_te = np.asarray(te.vectors, dtype=np.float32).reshape(len(te), -1)
    return fewshot_evaluate(x_tr, tr.labels, x_te, te.labels, K, shots, seeds, l2, heldout_per_class, l2_grid)
