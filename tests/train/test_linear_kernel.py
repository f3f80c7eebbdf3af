"""The training kernels' Linear GEMM (oneDNN on a reordered weight, ``CpuTrainingKernels.linear``) and the
autograd function that uses it (``vitkit.models.fused.linear``), against float64 products, PyTorch's own
bf16 ``addmm`` and autograd through ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from vitkit.models.fused import TorchKernels, linear
from vitkit.train import kernels

LOADED = kernels.load()
needs_linear = pytest.mark.skipif(
    LOADED is None or not LOADED.linear_supported(torch.empty(0, dtype=torch.bfloat16)),
    reason="no C compiler, no AVX-512 BF16 or no oneDNN bf16 linear on this CPU",
)
BF16_ULP = 2.0**-8
# (rows, in, out): S/16's four Linears at batch 32 and 1 image, odd tails below the GEMM's register blocks
SHAPES = [(6304, 384, 1152), (197, 1536, 384), (197, 384, 1536), (1, 1, 1), (7, 5, 3), (33, 17, 9), (50, 64, 130)]


def _bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).bfloat16()


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per element: the output's bf16 rounding (one spacing) plus fp32 summation over K terms."""
    k = x.shape[-1]
    return BF16_ULP * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().t())


@needs_linear
@pytest.mark.parametrize(("rows", "d_in", "d_out"), SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_kernel_is_the_product_to_bf16_rounding(rows: int, d_in: int, d_out: int, transposed: bool) -> None:
    assert LOADED is not None
    torch.manual_seed(rows + d_in + d_out)
    x, b = _bf16(rows, d_in), _bf16(d_out)
    # the input gradient's weight is a transposed view (W^T of a (d_in, d_out) weight)
    w = _bf16(d_in, d_out, scale=d_in**-0.5).t() if transposed else _bf16(d_out, d_in, scale=d_in**-0.5)
    for bias in (b, None):
        y = LOADED.linear(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, d_out)
        ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        err = (y.double() - ref).abs()
        assert bool((err <= _bound(x, w, ref)).all()), float((err - _bound(x, w, ref)).max())
        theirs = torch.addmm(bias, x, w.t()) if bias is not None else torch.mm(x, w.t())  # PyTorch's own bf16 GEMM
        assert rel_err(y, ref) <= 1.25 * rel_err(theirs, ref) + 1e-6


@needs_linear
def test_linear_kernel_takes_bf16_cpu_activations_only() -> None:
    assert LOADED is not None
    assert LOADED.linear_supported(torch.empty(0, dtype=torch.bfloat16))
    assert not LOADED.linear_supported(torch.empty(0))  # fp32 trains through PyTorch's Linear
    assert not LOADED.linear_supported(torch.empty(0, dtype=torch.float64))
    assert not kernels.load(linear=False).linear_supported(torch.empty(0, dtype=torch.bfloat16))  # type: ignore[union-attr]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_pass_gradcheck_in_float64(bias: bool) -> None:
    """The autograd function (PyTorch's GEMMs behind the interface) against numerical derivatives."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(lambda x, w: linear(x, w, b, TorchKernels()), (x, w))
    if b is not None:
        assert torch.autograd.gradcheck(lambda b: linear(x, w, b, TorchKernels()), (b,))


AUTOCAST_SHAPES = [((2, 197), 384, 1152), ((3, 50), 1536, 384), ((1,), 5, 3), ((2, 7), 17, 9)]


@needs_linear
@pytest.mark.parametrize(("lead", "d_in", "d_out"), AUTOCAST_SHAPES)
def test_linear_under_autocast_matches_pytorchs_linear(lead: tuple[int, ...], d_in: int, d_out: int) -> None:
    """Output and the gradients of input, weight and bias under bf16 autocast, against autograd through
    F.linear in float64 on the same bf16-rounded values: within what PyTorch's own autocast Linear errs
    (x 1.25, + 1e-3), and in the dtypes autocast's Linear gives (bf16 output, fp32 parameter gradients)."""
    assert LOADED is not None
    torch.manual_seed(d_in)
    x = _bf16(*lead, d_in).float()
    w = _bf16(d_out, d_in, scale=d_in**-0.5).float().requires_grad_()
    b = _bf16(d_out, scale=0.1).float().requires_grad_()
    dy = _bf16(*lead, d_out)
    results = []
    for k in (LOADED, None):
        xk = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(xk, w, b) if k is None else linear(xk, w, b, k)
        assert y.dtype == torch.bfloat16
        grads = torch.autograd.grad(y, (xk, w, b), dy)
        assert all(g.dtype == torch.float32 for g in grads)
        results.append((y, *grads))
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(xr, wr, br)
    refs = (ref, *torch.autograd.grad(ref, (xr, wr, br), dy.double()))
    for ours, theirs, want in zip(*results, refs, strict=True):
        assert rel_err(ours, want) <= 1.25 * rel_err(theirs, want) + 1e-3


def test_linear_without_autocast_is_pytorchs_linear() -> None:
    """fp32 (no autocast) through the CPU kernels, or any dtype through PyTorch's: F.linear exactly."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 9, 16), torch.randn(8, 16), torch.randn(8)
    for k in (LOADED, TorchKernels()):
        if k is not None:
            torch.testing.assert_close(linear(x, w, b, k), F.linear(x, w, b), rtol=0, atol=0)
