"""The fused bf16 attention kernel (C, AVX-512 BF16) against PyTorch's fp32 scaled_dot_product_attention, and
the fast path with and without it against the model."""

from __future__ import annotations

import pytest
import torch

from helpers import ATTENTION_EDGE_D, ATTENTION_EDGE_T, ATTENTION_SHAPES, randomize_, rel_err, sdpa_tokens
from vitkit import hardware, native
from vitkit.inference import attention
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.models import create_model

KERNEL = attention.load()
# the AVX-512 kernel and its AMX variant (head widths other than multiples of 32 go to the AVX-512 one)
KERNELS = {"avx512": KERNEL, "amx": attention.load_amx()}


@pytest.fixture(params=list(KERNELS))
def kernel(request: pytest.FixtureRequest) -> attention.FusedAttention:
    found = KERNELS[request.param]
    if found is None:
        pytest.skip(f"the {request.param} attention kernel does not load here (no compiler or CPU support)")
    return found


needs_kernel = pytest.mark.skipif(
    KERNEL is None,
    reason="the fused attention kernel needs a C compiler and a CPU with AVX512_BF16"
    + ("" if native.compiler() else " (no C compiler here)")
    + ("" if {"avx512_bf16"} <= hardware.cpu_flags() else " (no AVX512_BF16 here)"),
)


@needs_kernel
@pytest.mark.parametrize(("batch", "T", "heads", "d"), ATTENTION_SHAPES)
def test_kernel_matches_fp32_sdpa(batch: int, T: int, heads: int, d: int, kernel: attention.FusedAttention) -> None:
    """T odd, below or not a multiple of the 6-row and 16-column blocks, 577 (384 px); d = 32/64/80, and 40
    and 2 whose last 16 columns are partial; batch 1."""
    qkv = torch.randn(batch * T, 3 * heads * d).to(torch.bfloat16)
    scale = d**-0.5
    out = kernel(qkv, batch, heads, d, scale)
    ref = sdpa_tokens(qkv, batch, heads, d, scale)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-2
    assert (out.float() - ref).abs().max() < 0.05


@needs_kernel
@pytest.mark.parametrize("T", ATTENTION_EDGE_T)
@pytest.mark.parametrize("d", ATTENTION_EDGE_D)
def test_kernel_at_block_and_tile_edges(T: int, d: int, kernel: attention.FusedAttention) -> None:
    """T on either side of the 12-row blocks (2 x 6 rows, the last one half empty), of the 16-key vectors
    (1, 2 and an odd number of them, so the exp loop's pairs end on a single vector) and of the key tiles
    (4 + 1, 4 + 3 + 2, 4 + 4 + 2 ... vectors); d = 34 and 48 pack keys 16 pairs at a time with a partial last
    group (1 and 8 pairs) and end on a partial 16-column output vector (34)."""
    qkv = (torch.randn(T, 3 * 2 * d) * 2).to(torch.bfloat16)
    out = kernel(qkv, 1, 2, d, d**-0.5)
    ref = sdpa_tokens(qkv, 1, 2, d, d**-0.5)
    assert rel_err(out, ref) < 1e-2
    assert (out.float() - ref).abs().max() < 0.05


@needs_kernel
def test_kernel_on_large_logits_and_strided_rows(kernel: attention.FusedAttention) -> None:
    """Logits up to ~+-300 (a naive exp overflows; softmax is then nearly one-hot), and qkv as a column slice
    of a wider tensor (row stride larger than 3D)."""
    batch, T, heads, d = 2, 197, 2, 64
    wide = torch.randn(batch * T, 3 * heads * d + 64) * 4
    qkv = wide.to(torch.bfloat16)[:, : 3 * heads * d]
    assert qkv.stride(0) != qkv.shape[1]
    out = kernel(qkv, batch, heads, d, 1.0)
    ref = sdpa_tokens(qkv, batch, heads, d, 1.0)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < 1e-2


@needs_kernel
@pytest.mark.parametrize(("part", "value"), [(0, "nan"), (1, "nan"), (1, "inf"), (1, "-inf"), (2, "nan")])
@pytest.mark.parametrize("d", [16, 64])  # 64: the AMX variant's own path
def test_kernel_propagates_nan_and_inf_like_sdpa(
    part: int, value: str, d: int, kernel: attention.FusedAttention
) -> None:
    """A NaN or infinite q or k entry makes the rows whose softmax it reaches NaN, as in PyTorch, instead of
    a finite average of v (a NaN image must not get a confident prediction)."""
    batch, T, heads = 1, 20, 1
    qkv = torch.randn(batch * T, 3 * heads * d).to(torch.bfloat16)
    qkv[5, part * heads * d + 3] = float(value)
    out = kernel(qkv, batch, heads, d, d**-0.5).float()
    ref = sdpa_tokens(qkv, batch, heads, d, d**-0.5)
    assert ref.isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert not ok.any() or (out[ok] - ref[ok]).abs().max() < 0.05


@needs_kernel
def test_kernel_rejects_what_it_cannot_run(kernel: attention.FusedAttention) -> None:
    assert not kernel.supports(torch.randn(10, 12), 2)  # fp32
    assert not kernel.supports(torch.randn(10, 9).to(torch.bfloat16), 3)  # odd head_dim
    with pytest.raises(ValueError, match="does not hold"):
        kernel(torch.randn(10, 12).to(torch.bfloat16), 3, 2, 2)
    qkv = torch.randn(10, 12).to(torch.bfloat16)
    with pytest.raises(ValueError, match="positive scale"):  # the kernel takes the row maximum before scaling
        kernel(qkv, 2, 2, 2, scale=-1.0)
    with pytest.raises(ValueError, match="refused its arguments"):  # no tokens: the kernel's -2, not MemoryError
        kernel(qkv[:0], 1, 2, 2)


def _model() -> torch.nn.Module:
    return randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=3)).eval()


@needs_kernel
def test_fast_path_uses_the_kernel_and_matches_the_torch_attention() -> None:
    model = _model()
    x = torch.randn(3, 3, 48, 48)
    fast = InferenceViT(model, torch.bfloat16, rows=None)
    blocks = [b for b in fast.blocks if isinstance(b, FastBlock)]
    assert all(b.fused is not None for b in blocks)
    with torch.inference_mode():
        ref = model(x)
        fused = fast(x)
        for b in blocks:
            b.fused = None  # the PyTorch path (batched GEMMs over chunks)
        plain = fast(x)
    assert rel_err(fused, plain) < 2e-2
    assert rel_err(fused, ref) < 3e-2


def test_without_the_kernel_the_fast_path_keeps_torch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or no AVX512_BF16): the kernel is not loaded and the fast path still matches the model."""
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert attention.load() is None
    model = _model()
    x = torch.randn(2, 3, 48, 48)
    fast = InferenceViT(model, torch.bfloat16, rows=None)
    assert all(b.fused is None for b in fast.blocks if isinstance(b, FastBlock))
    with torch.inference_mode():
        assert rel_err(fast(x), model(x)) < 3e-2
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "fma"})
    assert attention.load() is None


@pytest.mark.parametrize("T", ATTENTION_EDGE_T)
@pytest.mark.parametrize("d", [32, 96, 128])
def test_amx_kernel_at_its_head_widths_and_tile_edges(T: int, d: int) -> None:
    """The AMX variant's own widths (the edge tests' d = 34, 48 go to the AVX-512 kernel): T on either side of
    its 16-row query tiles and 32-key steps, d in 1 to 4 steps of 32 channels and 2 to 8 output tiles; the same
    error bound as the AVX-512 kernel's, and the AVX-512 kernel's own result within bf16 rounding."""
    amx = KERNELS["amx"]
    if amx is None:
        pytest.skip("the AMX attention kernel does not load here (no compiler or no AMX-BF16)")
    assert amx.amx_takes(d)
    qkv = (torch.randn(2 * T, 3 * 2 * d) * 2).to(torch.bfloat16)
    out = amx(qkv, 2, 2, d, d**-0.5)
    ref = sdpa_tokens(qkv, 2, 2, d, d**-0.5)
    assert rel_err(out, ref) < 1e-2
    assert (out.float() - ref).abs().max() < 0.05
    if KERNEL is not None:
        assert rel_err(out, KERNEL(qkv, 2, 2, d, d**-0.5)) < 1e-2
