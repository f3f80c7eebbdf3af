"""Per-row activation quantisation of the int8 path (fc1's output for fc2): the C kernel
(``NativeQuantizer.per_row``) computes ``quantize_dynamic_u8`` of each row (PyTorch ops), and the VNNI GEMM with a
scale and zero point per row computes the quantised formula (float64 reference) and agrees with oneDNN's GEMM
run row by row on the same codes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import int8_fast_path_switched, int8_gemm, native_quantizer, rel_err
from vitkit.inference import int8


def _rows_reference(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = [int8.quantize_dynamic_u8(row[None], qmax) for row in x]
    return torch.cat([p[0] for p in parts]), torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts])


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (16, 64), (111, 769), (300, 3072)])
@pytest.mark.parametrize("qmax", [255, 127])
def test_per_row_quantiser_equals_pytorch_row_by_row(shape: tuple[int, int], qmax: int) -> None:
    """Rows shorter than a vector, than a loop block, and with tails; rows all positive, all negative and
    mixed (each row's range must still contain 0): each row's scale and zero point those of
    ``quantize_dynamic_u8`` of that row, codes at most one step apart (x * (1/scale) against x / scale)."""
    torch.manual_seed(shape[0] + shape[1])
    offsets = torch.randn(shape[0], 1) * 8  # rows on either side of zero
    x = (torch.randn(shape) * torch.rand(shape[0], 1) * 4 + offsets).to(torch.bfloat16)
    q, scale, zero = native_quantizer(qmax).per_row(x)
    ref_q, ref_scale, ref_zero = _rows_reference(x, qmax)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and zero.dtype == torch.int32 and scale.shape == zero.shape == (shape[0],)
    assert torch.equal(scale, ref_scale) and torch.equal(zero.long(), ref_zero)
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3 and int(q.max()) <= qmax


def test_per_row_quantiser_nan_zero_rows_and_strided_rows() -> None:
    quantize = native_quantizer()
    torch.manual_seed(0)
    base = torch.randn(6, 100) * 2
    base[1] = 0.0  # an all-zero row: the clamped scale, zero point 0, codes 0
    base[3, 7] = float("nan")  # left out of its row's range, coded 0
    x = base.to(torch.bfloat16)
    q, scale, zero = quantize.per_row(x)
    assert torch.equal(q[1], torch.zeros(100, dtype=torch.uint8)) and int(zero[1]) == 0
    assert float(scale[1]) == pytest.approx(1e-8)
    assert int(q[3, 7]) == 0
    finite = x[3].clone()
    finite[7] = 0.0
    assert torch.equal(scale[3], int8.quantize_dynamic_u8(finite[None])[1])
    wide = torch.randn(6, 160).to(torch.bfloat16)
    view = wide[:, :100]  # rows 160 apart
    got, want = quantize.per_row(view), quantize.per_row(view.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="bf16"):
        quantize.per_row(torch.randn(4, 8))


def _gemm_reference(
    layer: int8.Int8Linear,
    linear: nn.Linear,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    epilogue: str,
    other: torch.Tensor | None,
) -> torch.Tensor:
    """y = scale[m] w_scale[n] (q[m] - zero[m]) . qw[n] + bias[n], then the epilogue, in float64, with the layer's
    own int8 weights and scales (read back from its packing)."""
    assert layer.gemm is not None and layer.packed is not None
    qw = layer.gemm.unpack_weights(layer.packed, *layer.weight_shape).double()
    w_scale = layer.w_scale.double()
    y = (q.double() - zero.double()[:, None]) @ qw.T * scale.double()[:, None] * w_scale
    y = y + linear.bias.detach().double()
    if epilogue == "gelu":
        return 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    if epilogue == "add":
        assert other is not None
        return y + other.double()
    return y


@pytest.mark.parametrize("shape", [(1, 4, 1), (7, 3, 5), (9, 68, 33), (37, 130, 50), (101, 770, 145), (64, 3072, 96)])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "add"])
def test_gemm_with_per_row_scales_equals_the_quantised_formula(shape: tuple[int, int, int], epilogue: str) -> None:
    g, quantize = int8_gemm(), native_quantizer()
    M, K, N = shape
    torch.manual_seed(M * 1000 + K + N)
    linear = nn.Linear(K, N)
    layer = int8.Int8Linear(linear, torch.bfloat16, epilogue, M, quantize, g)
    x = (torch.randn(M, K) * torch.rand(M, 1) * 4 + torch.randn(M, 1)).to(torch.bfloat16)  # rows of own ranges
    other = torch.randn(M, N).to(torch.bfloat16) if epilogue == "add" else None
    q, scale, zero = quantize.per_row(x)
    y = layer.forward_quantized(q, scale, zero, other)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N) and layer._onednn is None
    ref = _gemm_reference(layer, linear, q, scale, zero, epilogue, other)
    torch.testing.assert_close(y.double(), ref, rtol=2.0**-8, atol=1e-5 * float(ref.abs().max()))


def test_gemm_with_per_row_scales_agrees_with_onednn_row_by_row() -> None:
    """oneDNN's GEMM takes one scale and zero point per tensor: run it on each row's codes alone."""
    g, quantize = int8_gemm(), native_quantizer()
    if not int8.has_onednn_int8():
        pytest.skip("no oneDNN int8 kernels in this PyTorch")
    torch.manual_seed(1)
    M, K, N = 24, 3072, 96
    linear = nn.Linear(K, N)
    mine = int8.Int8Linear(linear, torch.bfloat16, "add", M, quantize, g)
    onednn = int8.Int8Linear(linear, torch.bfloat16, "add", 1, int8.quantize_dynamic_u8)
    x = (torch.randn(M, K) * torch.rand(M, 1) * 3).to(torch.bfloat16)
    other = torch.randn(M, N).to(torch.bfloat16)
    q, scale, zero = quantize.per_row(x)
    y = mine.forward_quantized(q, scale, zero, other).float()
    ref = torch.cat(
        [onednn.forward_quantized(q[i : i + 1], scale[i], zero[i].long(), other[i : i + 1]) for i in range(M)]
    ).float()
    torch.testing.assert_close(y, ref, rtol=2.0**-7, atol=1e-3 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="per-row"):  # oneDNN's path cannot take per-row scales
        onednn.forward_quantized(q, scale, zero, other)
    with pytest.raises(ValueError, match="per-row"):
        g(q, scale[:-1], zero[:-1], mine.packed, mine.colsum, mine.w_scale, mine.bias, "add", other)  # type: ignore[arg-type]


def test_int8_fast_path_quantises_fc1_output_per_row_where_the_kernels_load() -> None:
    """Each block's fc2 takes fc1's output quantised per row; the logits stay within int8 noise of those with
    the per-tensor quantiser, and as close to fp32."""
    int8_gemm(), native_quantizer()
    rows, ref, tensor = int8_fast_path_switched("rows_quantize", None, lambda b: b.rows_quantize is not None)
    assert rel_err(rows, ref) < 0.1 and rel_err(rows, tensor) < 0.05
    assert rel_err(rows, ref) < 1.25 * rel_err(tensor, ref)  # per row: no less accurate than per tensor
