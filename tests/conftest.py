"""pytest fixtures shared by every test; plain helper functions live in tests/helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_SKIP = "gpu: needs a CUDA device (torch.cuda.is_available() is False here)"

# The CPU kinds this project meets, as ``--precision auto`` sees them: (bf16 matmuls measured faster than fp32:
# AMX Xeons, AMD Zen 4/5; the fp32 fast path pays: AVX-512). "native" measures this machine.
CPU_KINDS = {"avx2": (False, False), "avx512": (False, True), "amx": (True, True)}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-kind",
        choices=("native", *CPU_KINDS),
        default="native",
        help="run every test as if on this CPU kind: --precision auto's two measurements (does bf16 beat fp32, "
        "does the fp32 fast path pay) and the fast path's kernel races are faked to its answers (the kernels "
        "stay this machine's)",
    )


def fake_cpu_kind(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Make ``--precision auto`` decide as on a CPU of ``kind`` (a key of ``CPU_KINDS``): the engine's two
    measurements answer as there. Only the decision is faked; bf16 runs on any CPU (emulated where not native)."""
    from vitkit.inference import policy

    bf16_wins, fast_pays = CPU_KINDS[kind]

    def gpu(device: torch.device | str) -> bool:
        return torch.device(device).type != "cpu"  # a GPU answers as before: bf16 and the fast path win

    monkeypatch.setattr(policy, "bf16_is_faster", lambda device="cpu": bf16_wins or gpu(device))
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": fast_pays or gpu(device))
    # the fast path's kernel races (vitkit.inference.tune): on AMX, PyTorch's own (oneDNN tile) kernels and the
    # plain model win, as measured on a Xeon of family 6 model 207; elsewhere the built-in kernels (the first
    # candidate of each race) do. Faked answers are not written to the tuning cache.
    from vitkit.inference import tune

    def timer(fns: object) -> dict[str, float]:
        names = list(fns)  # type: ignore[call-overload]
        step = -2.0 if kind == "amx" else 2.0
        return {name: 10.0 + step * i for i, name in enumerate(names)}

    monkeypatch.setattr(tune, "default_timer", timer)
    monkeypatch.setattr(tune, "_cache_file", lambda: None)


@pytest.fixture(autouse=True)
def _cpu_kind_option(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    kind = request.config.getoption("--cpu-kind")
    if kind != "native":
        fake_cpu_kind(monkeypatch, kind)


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per CPU kind, ``--precision auto`` deciding as there (see :func:`fake_cpu_kind`)."""
    fake_cpu_kind(monkeypatch, request.param)
    return str(request.param)


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
