"""Plain helper functions shared by tests (import from here, not from conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitkit import hardware
from vitkit.inference import gemm_int8, int8
from vitkit.models import VisionTransformer, create_model

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).parents[1] / "src"

# ``@pytest.mark.parametrize("device", DEVICES)``: a behaviour test on every device there can be; the CUDA case is
# marked ``gpu`` and skipped (saying why) without CUDA (conftest.py)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full precision on CUDA (no TF32) while inside, as on the CPU: for tests
    that compare the GPU with the CPU to fp32 rounding (PyTorch computes cuDNN convolutions in TF32 by default)."""
    previous = hardware.use_tf32(torch.device("cpu"), enabled=False)
    try:
        yield
    finally:
        hardware.restore_tf32(previous)


def file_modes(root: Path) -> dict[str, str]:
    """Mode (octal) of everything under ``root`` (``root`` itself as "."), files and folders."""
    found = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root)): f"{p.stat().st_mode & 0o7777:o}" for p in found}


def umask_modes(root: Path, umask: int) -> dict[str, str]:
    """What :func:`file_modes` should say under ``umask``: 0666 & ~umask for files, 0777 & ~umask for folders
    (what vitkit promises for every checkpoint it writes; fileio)."""
    found = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root)): f"{(0o777 if p.is_dir() else 0o666) & ~umask:o}" for p in found}


def rel_err(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    """Relative L2 error ||a - b|| / ||b|| for two tensors (of any float dtypes, compared in float64) or two
    arrays."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm())
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def same_top1_where_decided(out: torch.Tensor, ref: torch.Tensor, rel: float) -> int:
    """Assert that ``out`` (B, K) has ``ref``'s top-1 in every row whose ``ref`` margin (top-1 minus top-2 logit)
    exceeds twice ``rel`` times the row's L2 norm: a row computed to within ``rel`` of its norm cannot change its
    top-1 there, so a change means that row is wrong beyond the precision's error (a near-tie of random weights
    may flip and is not compared). Returns how many rows were compared (asserted > 0)."""
    ref = ref.detach().double()
    top2 = ref.topk(2, dim=-1).values  # (B, 2)
    decided = (top2[:, 0] - top2[:, 1]) > 2 * rel * ref.norm(dim=-1)
    assert bool(decided.any()), "no row has a margin above the error bound: nothing to compare"
    flipped = decided & (out.argmax(-1) != ref.argmax(-1))
    assert not bool(flipped.any()), f"rows {flipped.nonzero().flatten().tolist()} changed a decided top-1"
    return int(decided.sum())


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


def tiny_checkpoint(folder: Path, class_names: list[str]) -> Path:
    """A random-weight ViT small enough for job tests (16 px images, patches of 8, width 32, depth 2), saved in
    vitkit's format at ``folder/m`` with ``class_names``."""
    import vitkit
    from vitkit.checkpoints.preprocess import Preprocess

    model = randomize_(create_model("Ti/16", patch_size=8, image_size=16, hidden_size=32, depth=2, num_heads=2,
                                    mlp_dim=32, num_classes=len(class_names)))  # fmt: skip
    return vitkit.save_pretrained(model.eval(), folder / "m", preprocess=Preprocess(image_size=16),
                                  class_names=class_names)  # fmt: skip


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``vitkit ARGV`` in-process: (exit status, stdout, stderr)."""
    from vitkit.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse exits for --help and usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# Shapes (batch, T, heads, d) for the fused attention kernels of the inference fast path: T odd, below or not a
# multiple of the 6-row and 16-column blocks, 577 (384 px); d = 32/64/80, and 40 and 2 whose last 16 columns
# are partial; batch 1. And the edge grid of T around block and tile edges, for d = 34/48/64.
ATTENTION_SHAPES = [
    (2, 197, 3, 64),
    (1, 50, 2, 32),
    (3, 37, 2, 80),
    (1, 1, 1, 64),
    (2, 16, 4, 64),
    (1, 97, 2, 40),
    (2, 65, 1, 2),
    (1, 577, 2, 64),
]
ATTENTION_EDGE_T = [2, 11, 12, 13, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 80, 113, 145, 160, 161]
ATTENTION_EDGE_D = [34, 48, 64]


def sdpa_tokens(qkv: torch.Tensor, batch: int, heads: int, d: int, scale: float) -> torch.Tensor:
    """fp32 SDPA of the fused projection's (B*T, 3 h d) rows (as the attention kernels read them) -> (B*T, h d)."""
    BT = qkv.shape[0]
    q, k, v = qkv.float().view(batch, BT // batch, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, h, T, d)
    o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, h, T, d)
    return o.transpose(1, 2).reshape(BT, heads * d)


def native_quantizer(qmax: int = 255) -> int8.NativeQuantizer:
    """The int8 path's C activation quantiser, or skip the test where it cannot be built."""
    q = int8.load_native_quantizer(qmax, int8.quantize_dynamic_u8)
    if q is None:
        pytest.skip("the C quantiser needs AVX-512 and a C compiler")
    return q


def int8_gemm() -> gemm_int8.Int8Gemm:
    """The VNNI int8 GEMM kernel, or skip the test where it cannot be built."""
    g = gemm_int8.load()
    if g is None:
        pytest.skip("the int8 GEMM kernel needs AVX512_VNNI and AVX512_BF16 and a C compiler")
    return g


def int8_fast_path_switched(
    attr: str, off: object, ready: Callable[[torch.nn.Module], bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 3-block Ti/16 (48 px, random weights) through the int8 fast path, whose every block must be ``ready``:
    the logits as built, fp32's, and the logits once each block's ``attr`` is set to ``off`` (the feature off)."""
    from vitkit import optimize_for_inference
    from vitkit.inference.fast import FastBlock, Kernels

    model = randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=3)).eval()
    fast = optimize_for_inference(model, int8=True, kernels=Kernels(gemm="vnni"))  # the kernel, on AMX CPUs too
    blocks = [b for b in fast.modules() if isinstance(b, FastBlock)]
    assert blocks and all(ready(b) for b in blocks)
    x = torch.randn(4, 3, 48, 48)
    with torch.inference_mode():
        on, ref = fast(x).float(), model(x)
        for b in blocks:
            setattr(b, attr, off)
        switched = fast(x).float()
    return on, ref, switched
