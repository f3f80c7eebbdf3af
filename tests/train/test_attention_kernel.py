"""vitkit's C attention kernel for training (vitkit.train.kernels, attention.c): forward and the gradients of
q, k and v against PyTorch's fp32 SDPA through autograd, at token counts and head widths that leave tails
(T = 1, 2, 17, 50, 197, 257; d = 32, 64), and the model trained through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_, rel_err
from vitkit.models import create_model
from vitkit.models.attention import softmax_attention
from vitkit.models.kernel_paths import set_fused_attention, set_training_kernels
from vitkit.train import kernels

LOADED = kernels.load()
needs_kernel = pytest.mark.skipif(
    LOADED is None or LOADED.attention_lib is None, reason="no C compiler or no AVX-512 BF16 on this CPU"
)


def _sdpa(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    B, T, three_d = qkv.shape
    q, k, v = qkv.reshape(B, T, 3, heads, three_d // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(B, T, three_d // 3)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error over the largest reference magnitude: every element, the padding rows' too."""
    return float((got.detach().float() - want.detach()).abs().max() / want.detach().abs().max())


@needs_kernel
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("T", [1, 2, 17, 50, 197, 257])
def test_kernel_forward_and_gradients_match_fp32_sdpa(T: int, d: int) -> None:
    """bf16 inputs; the reference runs fp32 SDPA on the same (bf16-rounded) values. Error: the largest
    difference over the largest reference magnitude, for the output and each of dq, dk, dv, every element
    (padding rows included). Bound: 1.5%, or 1.25x the error of PyTorch's own bf16 explicit path on the same
    input where that is larger (dS = P (dP - D) cancels where P is nearly one-hot: at T = 2 both err 2-3% in dq)."""
    assert LOADED is not None
    torch.manual_seed(T * 100 + d)
    B, heads, scale = 2, 3, d**-0.5
    qkv = (torch.randn(B, T, 3 * heads * d) * 2).bfloat16()
    grad = torch.randn(B, T, heads * d).bfloat16()
    assert LOADED.attention_supported(qkv, heads)
    x = qkv.float().requires_grad_()
    ref = _sdpa(x, heads, scale)
    (ref_grad,) = torch.autograd.grad(ref, x, grad.float())
    ref3 = ref_grad.reshape(B, T, 3, -1)
    errors = []
    for k in (None, LOADED):  # PyTorch's bf16 path, the kernel
        y = qkv.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = softmax_attention(y, heads, scale, k)
        (got_grad,) = torch.autograd.grad(out, y, grad)
        assert out.dtype == got_grad.dtype == torch.bfloat16
        got3 = got_grad.reshape(B, T, 3, -1)
        if T == 1:  # one token: the softmax is constant, dq = dk = 0 (up to fp32 summation order)
            assert got3[:, :, :2].abs().max() < 1e-4 * ref3[:, :, 2].abs().max()
            errors.append([_max_rel(out, ref), _max_rel(got3[:, :, 2], ref3[:, :, 2])])
        else:
            errors.append([_max_rel(out, ref), *(_max_rel(got3[:, :, i], ref3[:, :, i]) for i in range(3))])
    for name, torch_err, kernel_err in zip(("out", "dq", "dk", "dv")[-len(errors[0]) :], *errors, strict=True):
        assert kernel_err < max(1.5e-2, 1.25 * torch_err), (name, kernel_err, torch_err)


@needs_kernel
def test_kernel_is_deterministic_and_takes_any_thread_count() -> None:
    assert LOADED is not None
    torch.manual_seed(0)
    qkv = torch.randn(3, 50, 3 * 2 * 64).bfloat16()
    grad = torch.randn(3, 50, 128).bfloat16()
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, threads, 5):  # more threads than cores: the per-thread buffers must not collide
            torch.set_num_threads(n)
            out, probs = LOADED.attention(qkv, 2, 0.125)
            runs.append((out, LOADED.attention_backward(grad, qkv, probs, 2, 0.125)))
    finally:
        torch.set_num_threads(threads)
    for out, dqkv in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(dqkv, runs[0][1])


@needs_kernel
def test_kernel_takes_only_what_it_computes() -> None:
    assert LOADED is not None
    bf16 = torch.bfloat16
    assert LOADED.attention_supported(torch.empty(2, 197, 3 * 6 * 64, dtype=bf16), 6)
    assert not LOADED.attention_supported(torch.empty(2, 197, 3 * 6 * 64), 6)  # fp32: PyTorch's path
    assert not LOADED.attention_supported(torch.empty(2, 197, 3 * 6 * 63, dtype=bf16), 6)  # odd head width
    assert not LOADED.attention_supported(torch.empty(2, 5, 3 * 2 * 258, dtype=bf16), 2)  # wider than 256
    assert not LOADED.attention_supported(torch.empty(1, 4097, 3 * 64, dtype=bf16), 1)  # over 4096 tokens
    assert not LOADED.attention_supported(torch.empty(2, 197, 3 * 64, dtype=bf16).transpose(0, 1), 1)
    assert not LOADED.attention_supported(torch.empty(2, 197, 100, dtype=bf16), 6)  # not 3 h d wide
    with pytest.raises(ValueError, match="attention kernel"):
        LOADED.attention(torch.empty(2, 5, 3 * 63, dtype=bf16), 1, 1.0)
    qkv = torch.randn(1, 5, 3 * 64).bfloat16()
    out, probs = LOADED.attention(qkv, 1, 0.125)
    with pytest.raises(ValueError, match="the attention kernel's own"):
        LOADED.attention_backward(out, qkv, probs.float(), 1, 0.125)


@needs_kernel
def test_model_trains_through_the_kernel_like_through_pytorch_under_autocast() -> None:
    """One bf16-autocast step of a small ViT (two blocks, 3 heads of 64, 17 tokens): output and every
    parameter gradient with the C attention kernel against the same model on PyTorch's explicit path."""
    assert LOADED is not None
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=64, depth=2))
    set_fused_attention(model, False)
    x = torch.randn(4, 3, 64, 64)
    results = []
    for k in (None, kernels.load(gelu=False, softmax=False)):
        set_training_kernels(model, k)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x).float()
        out.square().sum().backward()
        results.append((out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (o_ref, g_ref), (o_k, g_k) = results
    assert rel_err(o_k, o_ref) < 2e-2
    assert rel_err(g_k, g_ref) < 3e-2
    assert g_ref.abs().max() > 0
