"""pytest fixtures shared by every test; plain helper functions live in tests/helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_SKIP = "gpu: needs a CUDA device (torch.cuda.is_available() is False here)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (and the CUDA cases of ``helpers.DEVICES``) run where CUDA is available and are
    skipped, with the reason in pytest's summary, everywhere else."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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
