"""models/vit.py is the paper's model: the training kernels' and LoRA's plumbing lives beside it
(models/kernel_paths.py), plugged in through ``Block.path``."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import vitkit.models.vit as vit_module
from helpers import randomize_
from vitkit.models import create_model
from vitkit.models.fused import TorchKernels
from vitkit.models.kernel_paths import KernelPath, set_fused_attention, set_training_kernels

PLUMBING = {"vitkit.models.fused", "vitkit.models.kernel_api", "vitkit.models.lora", "vitkit.models.kernel_paths"}
MAX_LINES = 600


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_model_file_imports_no_training_or_lora_plumbing_and_stays_short() -> None:
    path = Path(vit_module.__file__)
    assert not _imports(path) & PLUMBING, sorted(_imports(path) & PLUMBING)
    assert "softmax_attention" not in path.read_text()  # the explicit path's own backward is the training path's
    assert len(path.read_text().splitlines()) < MAX_LINES


def test_a_block_path_without_kernels_is_the_model_bitwise_and_leaves_the_state_dict_alone() -> None:
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=32, depth=2))
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    results = []
    for path in (None, KernelPath()):
        for blk in model.blocks:
            blk.path = path  # type: ignore[union-attr]
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (o0, g0), (o1, g1) = results
    assert torch.equal(o0, o1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    set_fused_attention(model, False)
    set_training_kernels(model, TorchKernels())
    assert all(blk.path == KernelPath(model.blocks[0].path.kernels) for blk in model.blocks)  # type: ignore[union-attr]
    assert list(model.state_dict()) == keys
