"""The C training kernels (vitkit.train.kernels) and the fused ops that use them (vitkit.models.fused),
against float64 references and PyTorch's autograd of the same formulas."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_, rel_err
from vitkit.models import create_model
from vitkit.models.attention import softmax_attention
from vitkit.models.fused import TorchKernels, linear_gelu
from vitkit.models.kernel_paths import KernelPath, set_fused_attention, set_training_kernels
from vitkit.train import kernels

LOADED = kernels.load()
needs_kernels = pytest.mark.skipif(LOADED is None, reason="no C compiler or no AVX-512 BF16 on this CPU")
BF16_ULP = 2.0**-8  # relative spacing of bfloat16 numbers (at worst)


def _gelu64(h: torch.Tensor) -> torch.Tensor:
    """Exact GELU in float64, Phi from ndtr (no 1 + erf cancellation in the negative tail)."""
    h = h.double()
    return h * torch.special.ndtr(h)


def _gelu_grad64(h: torch.Tensor) -> torch.Tensor:
    h = h.double()
    return torch.special.ndtr(h) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)


def _close_to_bf16(got: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0, atol: float | torch.Tensor = 0.0) -> None:
    """Every element within ``ulps`` bf16 spacings of the float64 reference (rounding alone is half a one)
    plus ``atol`` (a number or one per element)."""
    err = (got.double() - ref).abs()
    bound = ulps * BF16_ULP * ref.abs() + atol
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"{got.flatten()[worst]} vs {ref.flatten()[worst]}"


@needs_kernels
@pytest.mark.parametrize("shape", [(197, 1536), (3, 5, 17), (1, 1), (7, 15)])
def test_gelu_forward_is_exact_gelu_to_bf16_rounding(shape: tuple[int, ...]) -> None:
    assert LOADED is not None
    torch.manual_seed(0)
    h = (torch.randn(shape) * 3).bfloat16()
    special = torch.tensor([-12.0, -5.0, 0.0, 30.0])  # the far tail, zero, the identity range
    h.view(-1)[:4] = special[: h.numel()]
    y = LOADED.gelu(h)
    assert y.dtype == torch.bfloat16 and y.shape == h.shape
    # erf's absolute error (< 1.5e-7, the formula PyTorch's own erf uses) makes Phi's < 1e-7: |h| 1e-7 more
    tol = 1e-7 * h.double().abs() + 1e-30
    _close_to_bf16(y, _gelu64(h), atol=tol)
    _close_to_bf16(F.gelu(h), _gelu64(h), atol=tol)  # PyTorch's bf16 GELU meets the same bound


@needs_kernels
def test_gelu_forward_keeps_nan_and_inf_as_pytorch() -> None:
    assert LOADED is not None
    h = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0]).bfloat16()
    torch.testing.assert_close(LOADED.gelu(h), F.gelu(h), equal_nan=True)


@needs_kernels
@pytest.mark.parametrize(("rows", "cols"), [(6304, 1536), (197, 1543), (5, 3), (1, 16)])
def test_gelu_backward_and_bias_gradient_in_one_pass(rows: int, cols: int) -> None:
    assert LOADED is not None
    torch.manual_seed(0)
    h = (torch.randn(rows, cols) * 2).bfloat16()
    dy = torch.randn(rows, cols).bfloat16()
    dh, db = LOADED.gelu_backward_bias(dy, h)
    assert dh.dtype == torch.bfloat16 and db.dtype == torch.float32 and db.shape == (cols,)
    ref = dy.double() * _gelu_grad64(h)
    _close_to_bf16(dh, ref, atol=1e-7 * dy.double().abs() + 1e-30)  # Phi to 1e-7 (forward test)
    # db sums the unrounded fp32 products: within fp32 summation error of the float64 sum
    scale = ref.abs().sum(0)
    assert bool(((db.double() - ref.sum(0)).abs() <= 1e-5 * scale + 1e-7 * dy.double().abs().sum(0)).all())
    # PyTorch's own bf16 path (gelu_backward then a bf16 sum) is no closer than the kernel
    aten = torch.ops.aten.gelu_backward(dy, h).sum(0).double()
    assert rel_err(db.double(), ref.sum(0)) <= rel_err(aten, ref.sum(0)) + 1e-6


@needs_kernels
@pytest.mark.parametrize("shape", [(12, 197, 197), (2, 3, 1), (4, 15), (4, 16), (3, 17), (2, 4096)])
def test_softmax_in_place_is_softmax_to_bf16_rounding(shape: tuple[int, ...]) -> None:
    assert LOADED is not None
    torch.manual_seed(0)
    x = (torch.randn(shape) * 5).bfloat16()
    ref = torch.softmax(x.double(), dim=-1)
    y = x.clone()
    assert LOADED.softmax_supported(y)
    out = LOADED.softmax_(y)
    assert out.data_ptr() == y.data_ptr()
    _close_to_bf16(y, ref, atol=1e-12)


@needs_kernels
def test_kernels_take_only_what_they_compute() -> None:
    assert LOADED is not None
    assert not LOADED.gelu_supported(torch.empty(0))  # fp32: PyTorch's ops
    assert not LOADED.softmax_supported(torch.empty(2, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not LOADED.softmax_supported(torch.empty(1, 4097, dtype=torch.bfloat16))  # over the row limit
    assert LOADED.softmax_supported(torch.empty(1, 4096, dtype=torch.bfloat16))


def test_linear_gelu_gradients_pass_gradcheck_in_float64() -> None:
    """The fused autograd function (PyTorch's elementwise ops inside) against numerical derivatives."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: linear_gelu(*t, TorchKernels()), (x, w, b))


@needs_kernels
def test_linear_gelu_under_autocast_matches_pytorchs_linear_gelu() -> None:
    """fc1 -> GELU of S/16 (384 -> 1536, 2 x 197 tokens) with the C kernels under bf16 autocast, against
    autograd through nn.Linear + F.gelu in fp32 on the same bf16-rounded inputs; gradients in the
    parameters' dtype (fp32), as autocast's Linear gives them."""
    assert LOADED is not None
    torch.manual_seed(0)
    x = torch.randn(2, 197, 384).bfloat16().float()
    w = (torch.randn(1536, 384) * 384**-0.5).bfloat16().float().requires_grad_()
    b = (torch.randn(1536) * 0.1).bfloat16().float().requires_grad_()
    dy = torch.randn(2, 197, 1536)
    xk = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_gelu(xk, w, b, LOADED)
    assert y.dtype == torch.bfloat16
    gx, gw, gb = torch.autograd.grad(y, (xk, w, b), dy.bfloat16())
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32
    xr = x.clone().requires_grad_()
    ref = F.gelu(F.linear(xr, w, b))
    rx, rw, rb = torch.autograd.grad(ref, (xr, w, b), dy.bfloat16().float())
    assert rel_err(y.detach().float(), ref.detach()) < 1e-2
    for got, want in ((gx, rx), (gw, rw), (gb, rb)):
        assert rel_err(got, want) < 2e-2


@needs_kernels
def test_softmax_attention_with_the_softmax_kernel_matches_pytorch_softmax() -> None:
    softmax_only = kernels.load(attention=False)  # the whole-attention kernel: test_attention_kernel.py
    assert softmax_only is not None and not softmax_only.attention_supported(torch.empty(2, 197, 3 * 384), 6)
    torch.manual_seed(0)
    qkv = torch.randn(2, 197, 3 * 384).bfloat16()
    grad = torch.randn(2, 197, 384).bfloat16()
    outs, grads = [], []
    for k in (None, softmax_only):
        q = qkv.clone().requires_grad_()
        out = softmax_attention(q, 6, 64**-0.5, k)
        outs.append(out.detach().float())
        grads.append(torch.autograd.grad(out, q, grad)[0].float())
    assert rel_err(outs[1], outs[0]) < 1e-2
    assert rel_err(grads[1], grads[0]) < 2e-2


@needs_kernels
@pytest.mark.parametrize("options", [{}, {"attn_norm": True, "mlp_norm": True}, {"attn_norm": True, "mlp": "swiglu"}])
def test_model_with_kernels_trains_like_without_under_autocast_and_is_unchanged_in_fp32(options: dict) -> None:
    """The training route reads the block description too: EVA-CLIP's LayerNorm inside the attention and EVA-02's
    sub-LN of the MLP are computed on it as in the model's own forward."""
    assert LOADED is not None
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=32, depth=2, **options))
    set_fused_attention(model, False)
    x = torch.randn(4, 3, 32, 32)
    results = []
    for k in (None, LOADED):
        set_training_kernels(model, k)
        for autocast in (True, False):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x).float()
            out.square().sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results.append((out.detach(), grads))
    assert model.blocks[0].path == KernelPath(LOADED)  # type: ignore[union-attr]
    (_, g16), (o32, g32), (_, k16), (ko32, kg32) = results
    assert rel_err(k16, g16) < 3e-2
    torch.testing.assert_close(ko32, o32, rtol=0, atol=0)  # fp32: the kernels are not used at all
    torch.testing.assert_close(kg32, g32, rtol=0, atol=0)
    plain = copy.deepcopy(model)  # the model's own forward, no route: what the route must compute
    for blk in plain.blocks:
        blk.path = None
    with torch.no_grad():
        torch.testing.assert_close(o32, plain(x), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_a_model_with_kernels_copies_and_pickles() -> None:
    model = create_model("Ti/16", num_classes=5, image_size=32, depth=1)
    set_training_kernels(model, LOADED)
    copied = copy.deepcopy(model)
    assert copied.blocks[0].path.kernels is LOADED  # type: ignore[union-attr]
    restored = pickle.loads(pickle.dumps(model))
    assert restored.blocks[0].path.kernels is not None  # type: ignore[union-attr]
