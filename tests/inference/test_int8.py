"""The int8 path's C activation quantiser computes ``quantize_dynamic_u8``'s function (PyTorch ops)."""

from __future__ import annotations

import pytest
import torch

from helpers import int8_fast_path_switched, native_quantizer, rel_err
from vitkit.inference import int8


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (16, 64), (111, 769), (1576, 3072)])
@pytest.mark.parametrize("offset", [0.0, 7.5, -7.5])
@pytest.mark.parametrize("qmax", [255, 127])
def test_native_quantiser_equals_pytorch(shape: tuple[int, int], offset: float, qmax: int) -> None:
    """Every tensor size (tails shorter than a vector and than a loop block), ranges on both sides of zero and
    all on one side (the range must still contain 0), 8 and 7 bits: the same scale and zero point, and codes
    at most one step apart (x * (1/scale) against x / scale at exact half-way points)."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + offset).to(torch.bfloat16)
    q, scale, zero = native_quantizer(qmax)(x)
    ref_q, ref_scale, ref_zero = int8.quantize_dynamic_u8(x, qmax)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and zero.dtype == torch.int64
    assert torch.equal(scale, ref_scale) and torch.equal(zero, ref_zero)
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert int(q.max()) <= qmax


def test_native_quantiser_of_zeros_and_other_inputs() -> None:
    quantize = native_quantizer()
    q, scale, zero = quantize(torch.zeros(5, 40, dtype=torch.bfloat16))
    assert torch.equal(q, torch.zeros(5, 40, dtype=torch.uint8)) and int(zero) == 0
    assert torch.equal(scale, int8.quantize_dynamic_u8(torch.zeros(1))[1])  # the clamped 1e-8
    torch.manual_seed(0)
    x = torch.randn(33, 48)
    for other in (x, x.to(torch.bfloat16).t()):  # fp32, and a non-contiguous bf16 view: the PyTorch fallback
        for got, want in zip(quantize(other), int8.quantize_dynamic_u8(other), strict=True):
            assert torch.equal(got, want)


def test_int8_fast_path_quantises_with_the_c_kernel_where_it_loads() -> None:
    native_quantizer()
    quantize = int8.fast_quantizer()
    assert isinstance(quantize, int8.NativeQuantizer)
    assert isinstance(quantize.fallback, int8.CompiledQuantizer)


def _layernorm(D: int, seed: int = 0) -> torch.nn.LayerNorm:
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(D, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D) * 0.5 + 1)
        norm.bias.copy_(torch.randn(D) * 0.3)
    return norm


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 37), (16, 64), (111, 769), (1576, 768)])
@pytest.mark.parametrize("qmax", [255, 127])
def test_layernorm_quantiser_equals_layernorm_then_quantiser(shape: tuple[int, int], qmax: int) -> None:
    """LayerNorm fused with the quantiser against the composition it replaces, on row lengths with tails shorter
    than a vector and single rows: (1) against LayerNorm and quantisation in float64 (the kernel quantises the
    fp32 LayerNorm output): the same range, codes at most one step apart and rarely; (2) against PyTorch's
    bf16 LayerNorm then ``quantize_dynamic_u8`` (what the int8 path did before): at most one step apart, the
    bf16 rounding of the extremes moving the scale by up to ~2^-8."""
    M, D = shape
    norm, native = _layernorm(D), native_quantizer(qmax)
    fused = int8.LayerNormQuantize(norm, native, native)
    x = (torch.randn(M, D) * 2 + 0.5).to(torch.bfloat16)
    q, scale, zero = fused(x)
    assert q.dtype == torch.uint8 and q.shape == (M, D) and scale.dtype == torch.float32 and zero.dtype == torch.int64
    y = torch.nn.functional.layer_norm(x.double(), (D,), norm.weight.double(), norm.bias.double(), norm.eps)
    lo, hi = min(y.min().item(), 0.0), max(y.max().item(), 0.0)
    ref_scale = max((hi - lo) / qmax, 1e-8)
    assert scale.item() == pytest.approx(ref_scale, rel=1e-5)
    assert abs(int(zero) - round(-lo / ref_scale)) <= 1
    ref_q = torch.clamp(torch.round(y / scale.double()) + int(zero), 0, qmax)
    diff = (q.double() - ref_q).abs()
    assert diff.max() <= 1 and (diff > 0).double().mean() < 1e-3
    two_q, two_scale, two_zero = int8.quantize_dynamic_u8(norm(x), qmax)
    assert scale.item() == pytest.approx(two_scale.item(), rel=2**-7)
    if int(zero) == int(two_zero):
        assert (q.int() - two_q.int()).abs().max() <= 1
    # the values the codes stand for (also when the zero point moved by one): each within half a step of its
    # input, the inputs apart by the bf16 rounding of the LayerNorm output
    gap = (q.double() - int(zero)) * scale.double() - (two_q.double() - int(two_zero)) * two_scale.double()
    bound = 0.5 * (scale.double() + two_scale.double()) + (y - norm(x).double()).abs() + 1e-6
    assert bool((gap.abs() <= bound).all())


def test_layernorm_quantiser_nan_rows_and_other_inputs() -> None:
    """A row with NaN (LayerNorm makes the whole row NaN) is left out of the range and quantised to 0, as the C
    quantiser does with NaN; the other rows are what they are without it; rows further apart than their length
    give what their contiguous copy gives. Inputs the kernel does not take (fp32, a transposed view) go through
    LayerNorm then the quantiser."""
    norm, native = _layernorm(40), native_quantizer()
    fused = int8.LayerNormQuantize(norm, native, native)
    x = torch.randn(9, 40).to(torch.bfloat16)
    x[4, 7] = float("nan")
    q, scale, zero = fused(x)
    rest = torch.cat([x[:4], x[5:]])
    q_rest, scale_rest, zero_rest = fused(rest)
    assert torch.equal(q[4], torch.zeros(40, dtype=torch.uint8))
    assert torch.equal(torch.cat([q[:4], q[5:]]), q_rest)
    assert torch.equal(scale, scale_rest) and torch.equal(zero, zero_rest)
    assert torch.equal(native(norm(x))[0][4], torch.zeros(40, dtype=torch.uint8))  # the same NaN codes
    rows = torch.randn(9, 56).to(torch.bfloat16)[:, 3:43]  # rows 56 apart: read in place, as their copy
    for got, want in zip(fused(rows), fused(rows.contiguous()), strict=True):
        assert torch.equal(got, want)
    plain = int8.LayerNormQuantize(norm.float(), int8.quantize_dynamic_u8, native)
    for other in (torch.randn(6, 40), torch.randn(40, 6).t()):
        for got, want in zip(plain(other), int8.quantize_dynamic_u8(norm(other)), strict=True):
            assert torch.equal(got, want)


def test_int8_fast_path_fuses_layernorm_and_quantiser_where_the_kernel_loads() -> None:
    """Each block's norm1 -> qkv and norm2 -> fc1 go through the fused kernel; the logits stay those of the
    two-step path up to int8 noise (a one-step code difference on ~2% of the activations)."""
    native_quantizer()
    fused_ready = lambda b: b.fuse_norm and b.norm1_q.fn is not None  # noqa: E731
    fused, ref, two_step = int8_fast_path_switched("fuse_norm", False, fused_ready)
    assert rel_err(fused, ref) < 0.1 and rel_err(fused, two_step) < 0.05


@pytest.mark.parametrize("n", [40, 64 * 5 + 17])
def test_native_quantiser_leaves_nan_out_of_the_range(n: int) -> None:
    """NaN (in the loop's full blocks and in its tail) neither widens nor resets the range: the scale and the
    other codes are those of the tensor with 0 in its place, and NaN quantises to 0."""
    quantize = native_quantizer()
    torch.manual_seed(1)
    x = (torch.randn(n) * 3).to(torch.bfloat16)
    x[0], x[1] = -100.0, 90.0  # the extremes, in lanes 0 and 1 of the first vector
    x[16] = x[17] = x[n - 3] = float("nan")  # the same lanes of the next vector: NaN must not reset them
    clean = x.nan_to_num(0.0)
    q, scale, zero = quantize(x)
    ref_q, ref_scale, ref_zero = quantize(clean)
    assert torch.equal(scale, ref_scale) and torch.equal(zero, ref_zero)
    assert int(q[16]) == int(q[17]) == int(q[n - 3]) == 0
    keep = torch.ones(n, dtype=torch.bool)
    keep[16] = keep[17] = keep[n - 3] = False
    assert torch.equal(q[keep], ref_q[keep])
