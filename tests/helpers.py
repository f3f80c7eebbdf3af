"""Plain helper functions shared by tests (import from here, not from conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

from conftest import FIXTURES


def rel_err(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    """Relative L2 error ||a - b|| / ||b|| for two tensors or two arrays."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return float((a - b).norm() / b.norm())
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def official_io() -> tuple[torch.Tensor, np.ndarray]:
    """The official code's fixture batch (NCHW tensor) and the logits it produced for it."""
    io = np.load(FIXTURES / "official_vit_tiny.io.npz")
    return torch.from_numpy(io["inputs_nhwc"]).permute(0, 3, 1, 2), io["logits"]
