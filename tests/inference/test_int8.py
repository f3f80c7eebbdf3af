"""The int8 path's C activation quantiser computes ``quantize_dynamic_u8``'s function (PyTorch ops)."""

from __future__ import annotations

import pytest
import torch

from vitkit.inference import int8


def _native(qmax: int = 255) -> int8.NativeQuantizer:
    q = int8.load_native_quantizer(qmax, int8.quantize_dynamic_u8)
    if q is None:
        pytest.skip("the C quantiser needs AVX-512 and a C compiler")
    return q


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (16, 64), (111, 769), (1576, 3072)])
@pytest.mark.parametrize("offset", [0.0, 7.5, -7.5])
@pytest.mark.parametrize("qmax", [255, 127])
def test_native_quantiser_equals_pytorch(shape: tuple[int, int], offset: float, qmax: int) -> None:
    """Every tensor size (tails shorter than a vector and than a loop block), ranges on both sides of zero and
    all on one side (the range must still contain 0), 8 and 7 bits: the same scale and zero point, and codes
    at most one step apart (x * (1/scale) against x / scale at exact half-way points)."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + offset).to(torch.bfloat16)
    q, scale, zero = _native(qmax)(x)
    ref_q, ref_scale, ref_zero = int8.quantize_dynamic_u8(x, qmax)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and zero.dtype == torch.int64
    assert torch.equal(scale, ref_scale) and torch.equal(zero, ref_zero)
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert int(q.max()) <= qmax


def test_native_quantiser_of_zeros_and_other_inputs() -> None:
    quantize = _native()
    q, scale, zero = quantize(torch.zeros(5, 40, dtype=torch.bfloat16))
    assert torch.equal(q, torch.zeros(5, 40, dtype=torch.uint8)) and int(zero) == 0
    assert torch.equal(scale, int8.quantize_dynamic_u8(torch.zeros(1))[1])  # the clamped 1e-8
    torch.manual_seed(0)
    x = torch.randn(33, 48)
    for other in (x, x.to(torch.bfloat16).t()):  # fp32, and a non-contiguous bf16 view: the PyTorch fallback
        for got, want in zip(quantize(other), int8.quantize_dynamic_u8(other), strict=True):
            assert torch.equal(got, want)


def test_int8_fast_path_quantises_with_the_c_kernel_where_it_loads() -> None:
    _native()
    quantize = int8.fast_quantizer()
    assert isinstance(quantize, int8.NativeQuantizer)
    assert isinstance(quantize.fallback, int8.CompiledQuantizer)
