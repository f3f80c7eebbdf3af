"""Shared test helpers. Tests make their own small data or use the fixtures in tests/fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).parents[1] / "src"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def sample_jpeg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's bundled 'china.jpg' photo, written to a temporary file."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    path = tmp_path_factory.mktemp("img") / "china.jpg"
    Image.fromarray(load_sample_image("china.jpg")).save(path, quality=90)
    return path


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
