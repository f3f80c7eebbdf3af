"""The C LayerNorm of the bf16 fast path (AVX-512 BF16) against float64 layer_norm and PyTorch's bf16 LayerNorm,
and the fast path with it against the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import randomize_, rel_err
from vitkit import hardware, native
from vitkit.inference import int8, layernorm
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.inference.layernorm import NativeLayerNorm
from vitkit.models import create_model

KERNEL = layernorm.load()
needs_kernel = pytest.mark.skipif(
    KERNEL is None,
    reason="the C LayerNorm needs a C compiler and a CPU with AVX512_BF16"
    + ("" if native.compiler() else " (no C compiler here)")
    + ("" if {"avx512_bf16"} <= hardware.cpu_flags() else " (no AVX512_BF16 here)"),
)


def _norm(D: int, affine: bool = True, eps: float = 1e-6) -> nn.LayerNorm:
    norm = nn.LayerNorm(D, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.5)
            norm.bias.normal_(0.0, 0.5)
    return norm.to(torch.bfloat16)


def _ref64(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    w = None if norm.weight is None else norm.weight.double()
    b = None if norm.bias is None else norm.bias.double()
    return F.layer_norm(x.double(), norm.normalized_shape, w, b, norm.eps)


@needs_kernel
@pytest.mark.parametrize("D", [1, 2, 15, 16, 17, 31, 33, 48, 192, 384, 768, 1000])
@pytest.mark.parametrize("rows", [1, 3, 197])
def test_kernel_matches_float64_and_torch_bf16(D: int, rows: int) -> None:
    """D below, at and past the 16- and 32-column steps (masked tails), the ViT widths; rows with an offset
    mean (as the residual stream has) so the variance is not the raw second moment."""
    norm = _norm(D)
    x = (torch.randn(rows, D) * 3 + 5).to(torch.bfloat16)
    out = NativeLayerNorm(norm, KERNEL)(x)
    ref, torch_bf16 = _ref64(x, norm), norm(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    if D > 1:
        assert rel_err(out, ref) < 5e-3  # one bf16 rounding (2^-9 relative) of each output
        # never worse than PyTorch's own bf16 LayerNorm by more than a rounding step anywhere
        step = ref.abs().clamp_min(1e-3) * 2**-7
        assert ((out.double() - ref).abs() <= (torch_bf16.double() - ref).abs() + step).all()
    else:  # a single column normalises to exactly 0: the output is beta (PyTorch's is off by a step at times)
        assert torch.equal(out.double(), ref)


@needs_kernel
def test_kernel_on_strided_rows_without_affine_and_a_nan_row() -> None:
    """Rows as a column slice of a wider tensor (row stride > D), no weight/bias, a row with NaN and one with
    inf (both all NaN out, as in PyTorch), and a constant row (variance 0: eps keeps it finite, output 0)."""
    D = 40
    norm = _norm(D, affine=False, eps=1e-5)
    wide = torch.randn(9, D + 24).to(torch.bfloat16)
    x = wide[:, :D]
    x[2, 7] = float("nan")
    x[4, 0] = float("inf")
    x[6] = 2.5
    assert x.stride(0) == D + 24
    out = NativeLayerNorm(norm, KERNEL)(x)
    ref = _ref64(x, norm)
    assert torch.equal(out.isnan(), ref.isnan()) and out[2].isnan().all() and out[4].isnan().all()
    assert (out[6] == 0).all()
    ok = ~ref.isnan()
    assert (out.double()[ok] - ref[ok]).abs().max() < 0.02


def test_other_inputs_go_to_the_module() -> None:
    """fp32, 3-d and non-unit column stride inputs, or no kernel, are PyTorch's LayerNorm itself."""
    norm = _norm(24).float()
    wrapped = NativeLayerNorm(norm, KERNEL)
    x = torch.randn(2, 5, 24)
    assert torch.equal(wrapped(x), norm(x))
    assert torch.equal(wrapped(x[0]), norm(x[0]))
    bf = _norm(24)
    xt = torch.randn(24, 6).to(torch.bfloat16).t()  # (6, 24) with column stride 6
    assert torch.equal(NativeLayerNorm(bf, KERNEL)(xt), bf(xt))
    assert torch.equal(NativeLayerNorm(bf, None)(xt.contiguous()), bf(xt.contiguous()))


@needs_kernel
def test_fast_path_uses_the_kernel_and_stays_within_bf16_tolerance() -> None:
    model = randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=3)).eval()
    x = torch.randn(3, 3, 48, 48)
    fast = InferenceViT(model, torch.bfloat16, rows=None)
    norms = [m for m in fast.modules() if isinstance(m, NativeLayerNorm)]
    assert len(norms) == 2 * 3 + 1 and all(m.fn is not None for m in norms)
    assert all(isinstance(b.norm1, NativeLayerNorm) for b in fast.blocks if isinstance(b, FastBlock))
    with torch.inference_mode():
        ref, out = model(x), fast(x)
        tokens = fast.forward_features(x)
        for m in norms:
            m.fn = None  # PyTorch's bf16 LayerNorm
        plain = fast.forward_features(x)
        ref_tokens = model.forward_features(x)
    assert rel_err(out, ref) < 3e-2
    assert rel_err(tokens, ref_tokens) < 3e-2
    assert rel_err(tokens, plain) < 2e-2


def test_int8_and_fp32_fast_paths_keep_their_norms() -> None:
    model = randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=2)).eval()
    fast = InferenceViT(model, torch.float32, rows=None)
    assert all(m.fn is None for m in fast.modules() if isinstance(m, NativeLayerNorm))
    if int8.has_onednn_int8():  # int8 has its own LayerNorm (fused with the quantiser where it can be)
        fast = InferenceViT(model, torch.bfloat16, rows=None, int8=True)
        assert all(m.fn is None for m in fast.modules() if isinstance(m, NativeLayerNorm))
