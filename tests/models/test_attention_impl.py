"""The explicit (unfused) attention path computes the same function and gradients as fused SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_, rel_err
from vitkit.models import create_model
from vitkit.models.attention import softmax_attention
from vitkit.models.fused import TorchKernels
from vitkit.models.kernel_paths import set_fused_attention


def test_unfused_attention_same_outputs_and_gradients() -> None:
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=32, depth=2))
    x = torch.randn(3, 3, 32, 32)
    grads = []
    outs = []
    for fused in (True, False):
        set_fused_attention(model, fused)
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(model.blocks[0].attn.qkv.weight.grad.clone())  # type: ignore[union-attr]
    assert not model.blocks[1].attn.fused  # type: ignore[union-attr]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)  # fp32 summation order differs
    assert grads[0].abs().max() > 0


def _sdpa_reference(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """PyTorch's own attention on the same (B, T, 3D) projection, through autograd."""
    B, T, three_d = qkv.shape
    q, k, v = qkv.reshape(B, T, 3, heads, three_d // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, three_d // 3)


def test_softmax_attention_gradients_pass_gradcheck_in_float64() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 3 * 4, dtype=torch.float64, requires_grad=True)  # B 2, T 5, 3 heads of 4
    assert torch.autograd.gradcheck(lambda t: softmax_attention(t, 3, 4**-0.5), (qkv,))


def test_attention_through_the_kernels_interface_passes_gradcheck_and_equals_sdpa() -> None:
    """The branch that hands the whole attention to TrainingKernels (what vitkit's C kernel plugs into), with
    the PyTorch reference behind the interface: gradcheck in float64, and fp32 equal to SDPA through autograd."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 3 * 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax_attention(t, 3, 4**-0.5, TorchKernels()), (qkv,))
    x = torch.randn(3, 17, 3 * 48, requires_grad=True)
    grad = torch.randn(3, 17, 48)
    ours = softmax_attention(x, 4, 12**-0.5, TorchKernels())
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    ref = _sdpa_reference(x, 4)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-6)


def test_softmax_attention_equals_sdpa_with_its_gradients() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(3, 17, 3 * 48, requires_grad=True)
    grad = torch.randn(3, 17, 48)
    ours = softmax_attention(qkv, 4, 12**-0.5)
    (g_ours,) = torch.autograd.grad(ours, qkv, grad)
    ref = _sdpa_reference(qkv, 4)
    (g_ref,) = torch.autograd.grad(ref, qkv, grad)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-6)


def test_softmax_attention_under_bf16_autocast_stays_within_bf16_of_fp32() -> None:
    """A training-sized case (S/16: 197 tokens, 6 heads of 64) under autocast: bf16 products, gradients in
    bf16, within bf16 rounding of fp32 SDPA through autograd."""
    torch.manual_seed(0)
    qkv32 = torch.randn(2, 197, 3 * 384)
    grad = torch.randn(2, 197, 384)
    qkv16 = qkv32.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = softmax_attention(qkv16, 6, 64**-0.5)
    (g_ours,) = torch.autograd.grad(ours, qkv16, grad.bfloat16())
    assert ours.dtype == g_ours.dtype == torch.bfloat16
    ref_in = qkv16.detach().float().requires_grad_()  # same rounded inputs, fp32 math
    ref = _sdpa_reference(ref_in, 6)
    (g_ref,) = torch.autograd.grad(ref, ref_in, grad)
    assert rel_err(ours.detach().float(), ref.detach()) < 1e-2
    assert rel_err(g_ours.float(), g_ref) < 2e-2


def test_model_trains_through_softmax_attention_like_through_sdpa_under_autocast() -> None:
    """The model's explicit path (what the trainer runs on CPU) against the fused one, bf16 autocast."""
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=32, depth=2))
    x = torch.randn(4, 3, 32, 32)
    grads = []
    for fused in (True, False):
        set_fused_attention(model, fused)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x).float()
        out.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel_err(grads[1], grads[0]) < 3e-2


def test_softmax_attention_refuses_double_backward_in_plain_words() -> None:
    """Its backward writes into buffers, so it is not differentiable itself: asking for a second derivative
    says so (once_differentiable) instead of failing deep inside bmm's out= argument."""
    qkv = torch.randn(1, 5, 3 * 2 * 4, dtype=torch.float64, requires_grad=True)
    out = softmax_attention(qkv, 2, 0.5)
    (grad,) = torch.autograd.grad(out.square().sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
