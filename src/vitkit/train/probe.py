"""A linear head fitted on frozen features: multinomial logistic regression with an L2 penalty.

The objective, on features standardised with the training rows' mean and standard deviation (+1e-5), is

    mean_i CE(W x_i + b, y_i) + l2 / 2 ||W||^2          (the bias is not penalised)

-- scikit-learn's ``LogisticRegression(C=1 / (l2 N))`` on N rows, minimised by L-BFGS (PyTorch, float64) to a
gradient below ``tol``. ``l2`` is fixed, or chosen from :data:`L2_GRID` as the paper's few-shot protocol
chooses its ridge: by accuracy on held-out training examples (``heldout_fraction`` of every class, never
among the rows fitted), ties broken by the held-out cross-entropy; the head is then refitted on every row.
The standardisation is folded into the head written into the model (``W' = W / s``, ``b' = b - W' m``), so
the model takes the features as they come.

Rows may repeat an example (augmented feature passes, ``--feature-epochs``): ``examples`` names each row's
dataset index, so no augmented copy of a held-out example is fitted, and held-out scores use clean rows only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from vitkit.data.subset import stratified_holdout
from vitkit.errors import DataError
from vitkit.evaluate.fewshot import STD_EPS, l2_grid  # one grid rule and one epsilon for both probes
from vitkit.models.vit import VisionTransformer

L2_GRID = l2_grid(10.0, -6.0, 0.0, 0.5)  # 1e-6 .. 1, per row (the loss is a mean)
DEFAULT_L2 = 1e-3  # when held-out examples cannot be set aside (a class with a single example)
GRID_TOL = 1e-5  # gradient tolerance of the held-out fits (their accuracies only rank the grid)
HELDOUT_SALT = 0x4E1D  # the held-out examples' draw, apart from the validation split's of the same seed


def fit_logistic(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    num_classes: int,
    l2: float,
    *,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_iter: int = 1000,
    tol: float = 1e-7,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W (K, D), b (K,)) float64 minimising mean cross-entropy + l2/2 ||W||^2 on rows ``x`` (N, D), by L-BFGS
    (strong Wolfe line search) until the largest gradient entry is below ``tol``. The loss and its gradient
    are computed in closed form: dW = (softmax(z) - onehot(y))^T x / N + l2 W, db = sum of the same rows."""
    xt = torch.as_tensor(x, dtype=torch.float64)
    yt = torch.as_tensor(y, dtype=torch.int64)
    if xt.ndim != 2 or yt.shape != (xt.shape[0],) or xt.shape[0] == 0:
        raise ValueError(f"expected features (N, D) and labels (N,), got {tuple(xt.shape)} and {tuple(yt.shape)}")
    n, K, D = xt.shape[0], num_classes, xt.shape[1]
    w0, b0 = init if init is not None else (torch.zeros(K, D, dtype=torch.float64), torch.zeros(K, dtype=torch.float64))
    w, b = w0.detach().clone(), b0.detach().clone()
    rows = torch.arange(n)
    opt = torch.optim.LBFGS(
        [w, b], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter, tolerance_grad=tol, tolerance_change=1e-16,
        history_size=30, line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> torch.Tensor:
        z = xt @ w.T + b  # (N, K)
        lse = torch.logsumexp(z, dim=1)  # (N,)
        loss = (lse - z[rows, yt]).mean() + 0.5 * l2 * (w * w).sum()
        g = torch.exp(z - lse[:, None])  # softmax (N, K)
        g[rows, yt] -= 1.0
        g /= n
        w.grad = g.T @ xt + l2 * w  # (K, D)
        b.grad = g.sum(0)  # (K,)
        return loss

    with torch.no_grad():
        opt.step(closure)
    return w, b


@dataclass
class ProbeFit:
    """The fitted head in the raw feature space, and how its L2 strength was chosen."""

    weight: np.ndarray  # (K, R) float64, standardisation folded in
    bias: np.ndarray  # (K,) float64
    l2: float
    l2_mode: str  # "fixed", "auto" (held-out), or "default" (no held-out examples could be set aside)
    heldout: list[dict[str, float]] = field(default_factory=list)  # per grid value: l2, top1, loss
    heldout_count: int = 0
    train_top1: float = float("nan")
    notes: list[str] = field(default_factory=list)

    def logits(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64) @ self.weight.T + self.bias  # (N, K)

    def to_dict(self) -> dict[str, Any]:
        return {
            "l2": self.l2, "l2_mode": self.l2_mode, "heldout_count": self.heldout_count,
            "heldout": self.heldout, "train_top1": self.train_top1,
        }  # fmt: skip


def fit_probe(
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    *,
    examples: np.ndarray | None = None,
    clean: np.ndarray | None = None,
    l2: float | None = None,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    grid: Sequence[float] = L2_GRID,
    progress: bool = False,
) -> ProbeFit:
    """Fit the head on rows ``x`` (N, R), labels ``y``. ``examples`` (N,): each row's dataset example
    (default: row i is example i); ``clean`` (N,) bool: rows of the clean pass (default: all). ``l2`` None:
    chosen on held-out examples (see the module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    n = len(y)
    examples = np.arange(n) if examples is None else np.asarray(examples)
    clean = np.ones(n, dtype=bool) if clean is None else np.asarray(clean, dtype=bool)
    if n == 0:
        raise DataError("no training examples to fit a linear head on")
    missing = sorted(set(range(num_classes)) - set(np.unique(y).tolist()))
    if missing:
        raise DataError(f"class {missing[0]} has no training example; a linear head needs every class")
    mean = x.mean(axis=0)  # (R,)
    std = x.std(axis=0) + STD_EPS  # (R,)
    xs = torch.from_numpy((x - mean) / std)  # (N, R)
    yt = torch.from_numpy(y)
    fit = ProbeFit(np.zeros(0), np.zeros(0), float(l2 or DEFAULT_L2), "fixed" if l2 is not None else "auto")
    if l2 is None:
        # held out over the clean rows
        held_clean = stratified_holdout(y[clean], num_classes, heldout_fraction, seed, salt=HELDOUT_SALT)
        if held_clean is None:
            fit.l2_mode = "default"
            fit.notes.append(
                f"a class has a single training example: no held-out examples to choose the L2 strength on; "
                f"using {DEFAULT_L2:g} (--l2 to choose)"
            )
        else:
            held_rows = np.isin(examples, examples[clean][held_clean])  # every pass of a held-out example
            fit_rows = torch.from_numpy(~held_rows)
            val_rows = torch.from_numpy(held_rows & clean)
            fit.heldout_count = int(val_rows.sum())
            best: tuple[float, float, float] | None = None  # (-top1, loss, -l2): smallest wins
            init = None
            lams = sorted(grid, reverse=True)  # strongest first; each warm-starts the next
            bar = tqdm(lams, desc="choose l2", unit="fit", file=sys.stderr, disable=not progress, leave=False)
            for lam in bar:
                init = fit_logistic(xs[fit_rows], yt[fit_rows], num_classes, lam, init=init, tol=GRID_TOL)
                logits = xs[val_rows] @ init[0].T + init[1]
                top1 = float((logits.argmax(1) == yt[val_rows]).double().mean())
                loss = float(F.cross_entropy(logits, yt[val_rows]))
                fit.heldout.append({"l2": lam, "top1": top1, "loss": loss})
                score = (-top1, loss, -lam)
                if best is None or score < best:
                    best, fit.l2 = score, lam
    w, b = fit_logistic(xs, yt, num_classes, fit.l2)
    fit.train_top1 = float(((xs @ w.T + b).argmax(1) == yt).double().mean())
    w_raw = w.numpy() / std[None, :]  # (K, R)
    fit.weight, fit.bias = w_raw, b.numpy() - w_raw @ mean
    return fit


@torch.no_grad()
def write_head(model: VisionTransformer, fit: ProbeFit) -> None:
    """Put the fitted head into ``model`` (whose head must already map its features to K classes)."""
    head = model.head
    K, R = fit.weight.shape
    if not isinstance(head, nn.Linear) or tuple(head.weight.shape) != (K, R):
        raise ValueError(f"the model's head is not a Linear({R}, {K})")
    head.weight.copy_(torch.from_numpy(fit.weight).to(head.weight.dtype))
    head.bias.copy_(torch.from_numpy(fit.bias).to(head.bias.dtype))
