"""Start-up cost (issue 31, "Startup"): a command imports what it runs. ``import vitkit`` and building the command
line's parser import no torch; loading a checkpoint does not import PyTorch's compiler stack; the lazy names are
the same objects as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import vitkit

SRC = str(Path(__file__).parents[1] / "src")


def _modules_after(code: str) -> set[str]:
    """The modules loaded (sys.modules) after running ``code`` in a fresh interpreter."""
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={"PYTHONPATH": SRC}, capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


def test_the_parser_and_the_package_import_no_torch() -> None:
    """``vitkit --help``, ``vitkit eval --help`` and argument errors cost the interpreter, not PyTorch."""
    loaded = _modules_after("import vitkit\nfrom vitkit.cli import build_parser\nbuild_parser()")
    assert "torch" not in loaded and "PIL" not in loaded and "matplotlib" not in loaded
    assert "vitkit.train" not in loaded and "vitkit.checkpoints" not in loaded


def test_loading_a_checkpoint_does_not_import_the_compiler(tmp_path: Path) -> None:
    """The meta-device models that size a checkpoint before loading it are not initialised (PyTorch's normal_
    on meta tensors imports torch._dynamo: a second of every eval and predict)."""
    from helpers import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path, ["a", "b"])
    loaded = _modules_after(f"from vitkit import load_checkpoint\nload_checkpoint({str(ckpt)!r})")
    assert "torch" in loaded and "torch._dynamo" not in loaded


def test_lazy_public_names_are_the_library_objects() -> None:
    from vitkit.checkpoints import load_checkpoint
    from vitkit.configs.recipes import get_recipe
    from vitkit.evaluate.evaluate import evaluate_dataset
    from vitkit.train.trainer import train

    assert vitkit.load_checkpoint is load_checkpoint and vitkit.evaluate_dataset is evaluate_dataset
    assert vitkit.train is train  # the function, though the subpackage vitkit.train is imported by now
    assert vitkit.get_recipe is get_recipe
    assert all(hasattr(vitkit, name) for name in vitkit.__all__)
    assert set(vitkit.__all__) <= set(dir(vitkit))
    from vitkit import configs, evaluate

    for pkg in (configs, evaluate):
        assert all(hasattr(pkg, name) for name in pkg.__all__)


def test_convert_offers_every_format_with_a_writer() -> None:
    from vitkit.checkpoints import FORMATS
    from vitkit.commands.model import WRITABLE_FORMATS

    assert list(WRITABLE_FORMATS) == [f.name for f in FORMATS.values() if f.save is not None]


def test_a_model_on_the_meta_device_has_its_shapes() -> None:
    import torch

    from vitkit.models import create_model

    with torch.device("meta"):
        model = create_model("Ti/16", num_classes=3)
    real = create_model("Ti/16", num_classes=3)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}
