"""The int8 variant of the fused attention kernel (C, AVX-512 VNNI) against PyTorch's fp32
scaled_dot_product_attention and against its quantisation scheme written out in PyTorch, and the int8 fast
path's use of it."""

from __future__ import annotations

import pytest
import torch

from helpers import ATTENTION_EDGE_D, ATTENTION_EDGE_T, ATTENTION_SHAPES, randomize_, rel_err, sdpa_tokens
from vitkit import hardware, native
from vitkit.inference import attention
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.inference.int8 import has_onednn_int8
from vitkit.models import create_model

KERNEL = attention.load_int8()
needs_kernel = pytest.mark.skipif(
    KERNEL is None,
    reason="the int8 attention kernel needs a C compiler and a CPU with AVX512_BF16 and AVX512_VNNI"
    + ("" if native.compiler() else " (no C compiler here)")
    + ("" if {"avx512_bf16", "avx512_vnni"} <= hardware.cpu_flags() else " (no AVX512_BF16/VNNI here)"),
)

# Quantisation error, measured: q, k, v and the probabilities in 8 bits put 0.7-0.9% each into the output of
# diffuse attention on N(0, 1) inputs (rel. err 1.4e-2 together at T = 197, d = 64; the bf16 kernel 2.2e-3).
# It grows with T (more small probabilities rounded to 0 or 1/255) and with sharper logits: 2-3% at T = 113-577
# on N(0, 4) inputs. Hence 4e-2 against fp32; against the same scheme in PyTorch (``_emulate``) only the
# exp polynomial, ties and the bf16 output rounding differ: 1e-2.
SDPA_TOL = 4e-2
SCHEME_TOL = 1e-2


def _split(qkv: torch.Tensor, batch: int, heads: int, d: int) -> list[torch.Tensor]:
    T = qkv.shape[0] // batch
    return list(qkv.float().view(batch, T, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0))  # 3 x (B, h, T, d)


def _tokens(o: torch.Tensor) -> torch.Tensor:
    B, h, T, d = o.shape
    return o.transpose(1, 2).reshape(B * T, h * d)


def _emulate(qkv: torch.Tensor, batch: int, heads: int, d: int, scale: float) -> torch.Tensor:
    """The kernel's quantisation scheme in fp32 PyTorch (see attention_int8.c): k u8 per channel over the
    tokens with an offset, q times the key scales s8 per row, probabilities u8 (255 at the row maximum), v s8
    per channel."""
    q, k, v = _split(qkv, batch, heads, d)
    lo, hi = k.amin(-2, keepdim=True), k.amax(-2, keepdim=True)
    sk = (hi - lo) / 255
    kq = torch.round((k - lo) * torch.where(sk > 0, 255 / (hi - lo), 0))  # (B, h, T, d) in 0..255
    qs = q * sk
    aq = qs.abs().amax(-1, keepdim=True)
    qq = torch.round(qs * torch.where(aq > 0, 127 / aq, 0))  # (B, h, T, d) in -127..127
    s = qq.double() @ kq.double().transpose(-1, -2)  # integer scores, exact
    x = (s - s.amax(-1, keepdim=True)) * (scale * aq / 127).double()
    p = torch.round(255 * torch.exp(x)).float()  # (B, h, T, T) in 0..255
    av = v.abs().amax(-2, keepdim=True)
    vq = torch.round(v * torch.where(av > 0, 127 / av, 0))
    return _tokens((p @ vq) / p.sum(-1, keepdim=True) * (av / 127))


def _check(qkv: torch.Tensor, batch: int, heads: int, d: int, scale: float) -> None:
    assert KERNEL is not None
    out = KERNEL(qkv, batch, heads, d, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (qkv.shape[0], heads * d)
    assert rel_err(out, _emulate(qkv, batch, heads, d, scale)) < SCHEME_TOL
    assert rel_err(out, sdpa_tokens(qkv, batch, heads, d, scale)) < SDPA_TOL


@needs_kernel
@pytest.mark.parametrize(("batch", "T", "heads", "d"), [*ATTENTION_SHAPES, (2, 30, 2, 5), (1, 20, 1, 3)])
def test_int8_kernel_matches_fp32_sdpa_and_its_scheme(batch: int, T: int, heads: int, d: int) -> None:
    """The bf16 kernel's shapes (T odd, below or not a multiple of the blocks, 577; d = 2 .. 80, batch 1), and
    odd d (5, 3: the last quad of channels partly padding), which the int8 kernel takes too."""
    _check(torch.randn(batch * T, 3 * heads * d).to(torch.bfloat16), batch, heads, d, d**-0.5)


@needs_kernel
@pytest.mark.parametrize("T", ATTENTION_EDGE_T)
@pytest.mark.parametrize("d", ATTENTION_EDGE_D)
def test_int8_kernel_at_block_and_tile_edges(T: int, d: int) -> None:
    """T on either side of the 6-row blocks, the 16-key vectors, the 4-key quads of P x V and the key tiles;
    d = 34 and 48 end on a partial quad (34) and a partial 16-column vector (34, 48). Logits of std ~2."""
    _check((torch.randn(T, 3 * 2 * d) * 2).to(torch.bfloat16), 1, 2, d, d**-0.5)


@needs_kernel
def test_int8_kernel_on_large_logits_offsets_and_strided_rows() -> None:
    """Logits up to ~+-300 (softmax nearly one-hot), keys with a large common offset per channel (the offset
    is what the u8 keys take out; a symmetric s8 scheme would lose them to it), a constant key channel, and
    qkv as a column slice of a wider tensor (row stride larger than 3D). Against fp32 the error is larger
    here (9.5e-2): 8-bit q and k are off by ~0.5% of a logit range of hundreds, which moves a nearly one-hot
    softmax; the scheme itself is followed as closely as elsewhere."""
    batch, T, heads, d = 2, 197, 2, 64
    wide = torch.randn(batch * T, 3 * heads * d + 64) * 4
    wide[:, heads * d : 2 * heads * d] += torch.randn(heads * d) * 20  # k channels offset
    wide[:, heads * d + 5] = 3.0  # one constant key channel
    qkv = wide.to(torch.bfloat16)[:, : 3 * heads * d]
    assert qkv.stride(0) != qkv.shape[1]
    assert KERNEL is not None
    out = KERNEL(qkv, batch, heads, d, 1.0)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, _emulate(qkv, batch, heads, d, 1.0)) < SCHEME_TOL
    assert rel_err(out, sdpa_tokens(qkv, batch, heads, d, 1.0)) < 0.15


@needs_kernel
@pytest.mark.parametrize(("part", "value"), [(0, "nan"), (1, "nan"), (1, "inf"), (1, "-inf"), (2, "nan"), (2, "inf")])
def test_int8_kernel_is_not_finite_wherever_sdpa_is_not(part: int, value: str) -> None:
    """A NaN or infinite q, k or v entry: every output that SDPA makes NaN or infinite is NaN here (a NaN
    image must not get a confident prediction); the kernel may poison more (all of the (image, head) for k or
    v, the query's row for q). Other heads and images stay finite and close."""
    batch, T, heads, d = 2, 20, 2, 16
    qkv = torch.randn(batch * T, 3 * heads * d).to(torch.bfloat16)
    qkv[5, part * heads * d + 3] = float(value)  # image 0, head 0
    assert KERNEL is not None
    out = KERNEL(qkv, batch, heads, d, d**-0.5).float()
    ref = sdpa_tokens(qkv, batch, heads, d, d**-0.5)
    bad = ~torch.isfinite(ref)
    assert bad.any()
    assert out[bad].isnan().all()
    clean = torch.ones_like(ref, dtype=torch.bool)
    clean[:T, :d] = False  # image 0, head 0
    assert not out[clean].isnan().any()
    assert (out[clean] - ref[clean]).abs().max() < 0.1


@needs_kernel
def test_int8_kernel_rejects_what_it_cannot_run() -> None:
    assert KERNEL is not None
    assert not KERNEL.supports(torch.randn(10, 12), 2)  # fp32
    assert KERNEL.supports(torch.randn(10, 9).to(torch.bfloat16), 3)  # odd head_dim: fine in int8
    with pytest.raises(ValueError, match="does not hold"):
        KERNEL(torch.randn(10, 12).to(torch.bfloat16), 3, 2, 2)
    with pytest.raises(ValueError, match="positive scale"):
        KERNEL(torch.randn(10, 12).to(torch.bfloat16), 2, 2, 2, scale=-1.0)
    with pytest.raises(ValueError, match="refused its arguments"):
        KERNEL(torch.randn(0, 12).to(torch.bfloat16), 1, 2, 2)


@needs_kernel
@pytest.mark.skipif(not has_onednn_int8(), reason="int8 inference needs oneDNN's int8 kernels")
def test_int8_fast_path_uses_the_int8_kernel_and_bf16_keeps_bf16() -> None:
    model = randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=3)).eval()
    x = torch.randn(3, 3, 48, 48)
    int8 = InferenceViT(model, torch.bfloat16, rows=None, int8=True)
    bf16 = InferenceViT(model, torch.bfloat16, rows=None)
    int8_blocks = [b for b in int8.blocks if isinstance(b, FastBlock)]
    assert all(b.fused is not None and b.fused.int8 for b in int8_blocks)
    assert all(b.fused is not None and not b.fused.int8 for b in bf16.blocks if isinstance(b, FastBlock))
    with torch.inference_mode():
        ref = model(x)
        fused = int8(x)
        for b in int8_blocks:
            b.fused = attention.load()  # the same int8 path with the bf16 kernel
        plain = int8(x)
    assert rel_err(fused, plain) < 5e-2
    assert rel_err(fused, ref) < 8e-2


@needs_kernel
@pytest.mark.skipif(not has_onednn_int8(), reason="int8 inference needs oneDNN's int8 kernels")
def test_without_vnni_the_int8_fast_path_keeps_the_bf16_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with AVX512_BF16 but without AVX512_VNNI (Cooper Lake): no int8 variant, the bf16 kernel instead."""
    flags = hardware.cpu_flags() - {"avx512_vnni"}
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    assert attention.load_int8() is None
    model = randomize_(create_model("Ti/16", num_classes=11, image_size=48, depth=2)).eval()
    fast = InferenceViT(model, torch.bfloat16, rows=None, int8=True)
    assert all(b.fused is not None and not b.fused.int8 for b in fast.blocks if isinstance(b, FastBlock))


def _uniform_attention(T: int, d: int, v: torch.Tensor) -> torch.Tensor:
    """qkv of one image and one head with q = k = 0 (every probability 1/T, all u8 numerators 255) and values
    ``v`` (T,) in every channel, built for the kernel directly (a model at such T is minutes and gigabytes)."""
    qkv = torch.zeros(T, 3 * d, dtype=torch.bfloat16)  # (T, 3d)
    qkv[:, 2 * d :] = v[:, None].to(torch.bfloat16)
    return qkv


@needs_kernel
@pytest.mark.parametrize("T", [66_311, 66_312, 66_400])
def test_int8_kernel_long_rows_do_not_wrap_around(T: int) -> None:
    """The probabilities x values products sum 255 * 127 per key in int32: from T = 66,312 (255 * 127 * T >
    2^31; issue 25 item 9) they wrapped, the output of q = k = 0, v = 1 was -1.0 instead of 1.0. Just under
    the boundary and over it (a 4128 px image at patch 16 has 66,565 tokens; ViTConfig allows 2^20)."""
    assert KERNEL is not None
    d = 16
    out = KERNEL(_uniform_attention(T, d, torch.ones(T)), 1, 1, d, 1.0)  # (T, d)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.slow
@needs_kernel
def test_int8_kernel_carries_runs_of_keys_in_fp32() -> None:
    """Three runs of 65,536 keys (the last of 100): the first two add up in fp32 before the third. Values +1,
    +1, -1 by run, so each run's sum must land with its own sign and none may wrap (the total is far beyond
    2^31 in int32): the mean is (2 * 65,536 - 100) / T; a dropped run gives ~0.5 or ~0."""
    assert KERNEL is not None
    T, run, d = 2 * 65_536 + 100, 65_536, 16
    v = torch.ones(T)
    v[2 * run :] = -1
    out = KERNEL(_uniform_attention(T, d, v), 1, 1, d, 1.0).float()  # (T, d)
    torch.testing.assert_close(out, torch.full_like(out, (2 * run - 100) / T), rtol=2**-7, atol=0)


@needs_kernel
def test_int8_kernel_refuses_what_its_32_bit_offsets_cannot_reach() -> None:
    """Keys are gathered by 32-bit byte offsets t * 4 ceil(d / 4) and the softmax sums 255 T in int32: past
    2^31 the kernel is not asked (the fast path keeps PyTorch's attention). Stride-0 rows: no memory."""
    assert KERNEL is not None
    d = 1024
    row = torch.zeros(1, 3 * d, dtype=torch.bfloat16)
    assert KERNEL.supports(row.expand(2**21 - 1, 3 * d), d)
    assert not KERNEL.supports(row.expand(2**21, 3 * d), d)
    assert KERNEL.supports(row.expand(2 * (2**21 - 1), 3 * d), d, batch=2)  # per image
    row = torch.zeros(1, 3 * 4, dtype=torch.bfloat16)
    assert not KERNEL.supports(row.expand(2**31 // 255 + 1, 12), 4)  # the softmax sum
