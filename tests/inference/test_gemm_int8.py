"""The VNNI int8 GEMM (``vitkit.inference.gemm_int8``) computes Int8Linear's quantised formula: against a
float64 evaluation of the same formula, and against oneDNN's ``qlinear_pointwise`` on the same operands."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import int8_gemm, randomize_, rel_err
from vitkit.inference import int8
from vitkit.inference.fast import InferenceViT, Kernels
from vitkit.models import create_model


def _reference(layer: int8.Int8Linear, linear: nn.Linear, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """y = a_scale w_scale[n] (q - zp) . qw[n] + bias[n], then the epilogue, all in float64."""
    q, scale, zero = int8.quantize_dynamic_u8(x)
    w = linear.weight.detach().double()
    w_scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    qw = torch.clamp(torch.round(w / w_scale[:, None]), -128, 127)
    assert torch.equal(w_scale.float(), layer.w_scale)  # the same quantised weights as the layer's
    y = (q.double() - float(zero)) @ qw.T * float(scale) * w_scale + linear.bias.detach().double()
    if layer.epilogue == "gelu":
        return 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    if layer.epilogue == "gelu_tanh":
        return 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    if layer.epilogue == "add":
        assert other is not None
        return y + other.double()
    return y


# rows and columns that are and are not multiples of the 8-row blocks and 48-column panels (and shorter than
# one), K a multiple of 4, 4 x odd, and not a multiple of 4 (the zero-padded last group)
SHAPES = [(1, 4, 1), (7, 3, 5), (9, 68, 33), (37, 130, 50), (64, 768, 96), (101, 770, 145)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("epilogue", ["none", "gelu", "gelu_tanh", "add"])
def test_int8_gemm_equals_the_quantised_formula_in_float64(shape: tuple[int, int, int], epilogue: str) -> None:
    g = int8_gemm()
    M, K, N = shape
    torch.manual_seed(M * 1000 + K + N)
    linear = nn.Linear(K, N)
    layer = int8.Int8Linear(linear, torch.bfloat16, epilogue, M, int8.quantize_dynamic_u8, g)
    x = (torch.randn(M, K) * 2 + 0.5).to(torch.bfloat16)
    other = torch.randn(M, N).to(torch.bfloat16) if epilogue == "add" else None
    y = layer(x, other)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert layer.gemm is g and layer._onednn is None  # the kernel ran; oneDNN's weights were never made
    ref = _reference(layer, linear, x, other)
    # bf16 output: half a unit in the 8th bit (2^-9 relative); the fp32 epilogue adds ~1e-6 of the largest value
    torch.testing.assert_close(y.double(), ref, rtol=2.0**-8, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("epilogue", ["none", "gelu", "add"])
def test_int8_gemm_agrees_with_onednn(epilogue: str) -> None:
    """B/16's MLP shapes, cut down: the two GEMMs round the same exact int32 sums to bf16 through their own fp32
    epilogues, so they agree to a bf16 step, and nearly all outputs are equal."""
    g = int8_gemm()
    if not int8.has_onednn_int8():
        pytest.skip("no oneDNN int8 kernels in this PyTorch")
    torch.manual_seed(0)
    M, K, N = 200, 768, 384
    linear = nn.Linear(K, N)
    mine = int8.Int8Linear(linear, torch.bfloat16, epilogue, M, int8.quantize_dynamic_u8, g)
    onednn = int8.Int8Linear(linear, torch.bfloat16, epilogue, M, int8.quantize_dynamic_u8)
    x = torch.randn(M, K).to(torch.bfloat16)
    other = torch.randn(M, N).to(torch.bfloat16) if epilogue == "add" else None
    y, ref = mine(x, other).float(), onednn(x, other).float()
    torch.testing.assert_close(y, ref, rtol=2.0**-7, atol=1e-3 * float(ref.abs().max()))
    assert (y != ref).float().mean() < 0.02


def test_int8_gemm_leaves_what_it_does_not_take_to_onednn() -> None:
    g = int8_gemm()
    if not int8.has_onednn_int8():
        pytest.skip("no oneDNN int8 kernels in this PyTorch")
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)
    x = torch.randn(10, 64).to(torch.bfloat16)
    other = torch.randn(40, 10).to(torch.bfloat16).t()  # a residual without contiguous rows
    layer = int8.Int8Linear(linear, torch.bfloat16, "add", 10, int8.quantize_dynamic_u8, g)
    assert not g.supports(int8.quantize_dynamic_u8(x)[0], other, torch.bfloat16)
    y = layer(x, other)
    assert layer._onednn is not None  # made at this call
    ref = int8.Int8Linear(linear, torch.bfloat16, "add", 10, int8.quantize_dynamic_u8)(x, other.contiguous())
    torch.testing.assert_close(y.float(), ref.float(), rtol=2.0**-7, atol=1e-2)
    assert int8.Int8Linear(linear, torch.float32, "none", 10, None, g).gemm is None  # bf16 outputs only


def test_int8_gemm_refuses_arguments_that_do_not_fit() -> None:
    g = int8_gemm()
    qw = torch.randint(-128, 128, (50, 64), dtype=torch.int8)
    packed = g.pack_weights(qw)
    assert packed.data_ptr() % 64 == 0 and packed.numel() == 96 * 64  # N padded to two 48-column panels
    colsum, w_scale = qw.sum(dim=1, dtype=torch.int32), torch.full((50,), 0.01)
    q = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    scale, zero = torch.tensor(0.1), torch.tensor(3)
    with pytest.raises(ValueError, match="do not fit"):
        g(q[:, :60], scale, zero, packed, colsum, w_scale, None, "none")  # K of the activations != the weights'
    with pytest.raises(ValueError, match="residual"):
        g(q, scale, zero, packed, colsum, w_scale, None, "add", torch.zeros(8, 49, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int8"):
        g.pack_weights(qw.float())
    odd = torch.randint(-128, 128, (50, 66), dtype=torch.int8)  # K and N both padded
    assert torch.equal(g.unpack_weights(g.pack_weights(odd), 50, 66), odd)


def test_int8_fast_path_runs_its_gemms_on_the_kernel_where_it_loads() -> None:
    int8_gemm()
    model = create_model("Ti/16", num_classes=10, image_size=32).eval()
    fast = InferenceViT(model, torch.bfloat16, 4, int8=True, kernels=Kernels(gemm="vnni"))  # not oneDNN's, on AMX
    layers = [m for m in fast.modules() if isinstance(m, int8.Int8Linear)]
    assert layers and all(m.gemm is not None for m in layers)
    with torch.no_grad():
        y = fast(torch.randn(4, 3, 32, 32))
    assert y.shape == (4, 10) and torch.isfinite(y.float()).all()
    assert all(m._onednn is None for m in layers)


def test_int8_fast_path_with_an_mlp_wider_than_the_kernel_takes() -> None:
    """The kernel sums K <= 65536 products in int32; ViTConfig allows mlp_dim up to 262144. Such an fc2 must
    run oneDNN's GEMM (one scale per tensor) instead of raising (issue 25 item 10); the other layers keep the
    kernel, and the model's function is kept."""
    g = int8_gemm()
    if not int8.has_onednn_int8():
        pytest.skip("no oneDNN int8 kernels in this PyTorch")
    assert g.supports(torch.zeros(2, 65536, dtype=torch.uint8), None, torch.bfloat16)
    assert not g.supports(torch.zeros(2, 65537, dtype=torch.uint8), None, torch.bfloat16)
    model = create_model("Ti/16", num_classes=10, image_size=32, depth=1, hidden_size=32, num_heads=2, mlp_dim=65540)
    model = randomize_(model, std=0.02).eval()
    fast = InferenceViT(model, torch.bfloat16, 4, int8=True, kernels=Kernels(gemm="vnni"))
    block = fast.blocks[0]
    assert block.fc2.gemm is None and block.fc1.gemm is not None and block.qkv.gemm is not None
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        ref, out = model(x), fast(x)
    assert rel_err(out, ref) < 0.1
