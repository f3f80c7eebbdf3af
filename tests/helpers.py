"""Plain helper functions shared by tests (import from here, not from conftest.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vitkit.models import VisionTransformer, create_model

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).parents[1] / "src"


def rel_err(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    """Relative L2 error ||a - b|| / ||b|| for two tensors or two arrays."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return float((a - b).norm() / b.norm())
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def official_io() -> tuple[torch.Tensor, np.ndarray]:
    """The official code's fixture batch (NCHW tensor) and the logits it produced for it."""
    io = np.load(FIXTURES / "official_vit_tiny.io.npz")
    return torch.from_numpy(io["inputs_nhwc"]).permute(0, 3, 1, 2), io["logits"]


def meta_model(name: str, **overrides: object) -> VisionTransformer:
    """``create_model(name, **overrides)`` on the meta device: shapes and parameter counts, no memory."""
    with torch.device("meta"):
        return create_model(name, **overrides)


def randomize_(model: torch.nn.Module, std: float = 0.05) -> torch.nn.Module:
    """Give every parameter non-trivial random values (zero-initialised heads would hide bugs).

    LayerNorm scales are drawn around 1 so activations keep a sensible size.
    """
    with torch.no_grad():
        for m in model.modules():
            for name, p in m.named_parameters(recurse=False):
                p.normal_(0.0, std)
                if isinstance(m, torch.nn.LayerNorm) and name == "weight":
                    p.add_(1.0)
    return model


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``vitkit ARGV`` in-process: (exit status, stdout, stderr)."""
    from vitkit.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse exits for --help and usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
