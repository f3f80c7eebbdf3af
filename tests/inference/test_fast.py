"""optimize_for_inference computes the same function as the model it was made from."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_
from vitkit import hardware, optimize_for_inference
from vitkit.inference import int8
from vitkit.inference.fast import FastBlock, InferenceViT, chunk_rows
from vitkit.inference.int8 import Int8Linear
from vitkit.models import create_model


def _model(**overrides: object) -> torch.nn.Module:
    kw: dict = {"num_classes": 11, "image_size": 48, "depth": 3, **overrides}
    return randomize_(create_model("Ti/16", **kw)).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"gelu": "tanh"}, {"classifier": "gap"}, {"pos_embed": "sincos2d"}, {"representation_size": 32}],
)
def test_fp32_fast_path_matches_the_model(overrides: dict) -> None:
    model = _model(**overrides)
    x = torch.randn(4, 3, 48, 48)
    with torch.inference_mode():
        ref = model(x)
        out = optimize_for_inference(model, torch.float32, batch_size=4)(x)
        tokens = optimize_for_inference(model, torch.float32).forward_features(x)  # type: ignore[operator]
        ref_tokens = model.forward_features(x)
    assert ref.abs().max() > 0.1
    assert _rel(out, ref) < 1e-5
    assert _rel(tokens, ref_tokens) < 1e-5


def test_bf16_fast_path_within_bf16_tolerance_and_any_resolution() -> None:
    model = _model()
    fast = optimize_for_inference(model, batch_size=2)
    for size in (48, 64):  # 64: not the native grid, the position embedding is resampled like the model's
        x = torch.randn(8, 3, size, size)
        with torch.inference_mode():
            ref, out = model(x), fast(x)
        assert out.dtype == torch.bfloat16
        assert _rel(out, ref) < 3e-2
        # top-1 may only differ where bf16 rounding could swap the two best logits
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (out.float() - ref).abs().max()
        assert clear.sum() >= 4  # the check below covers most of the batch
        assert torch.equal(out.float().argmax(-1)[clear], ref.argmax(-1)[clear])


def test_unpacked_path_is_the_same_computation() -> None:
    """The plain F.linear path (used on CUDA and under torch.compile) equals the oneDNN-packed one."""
    model = _model()
    x = torch.randn(2, 3, 48, 48)
    packed = InferenceViT(model, torch.float32, rows=None, pack=True)
    plain = InferenceViT(model, torch.float32, rows=None, pack=False)
    with torch.inference_mode():
        assert _rel(packed(x), plain(x)) < 1e-5


def test_int8_fast_path_close_to_fp32() -> None:
    model = _model()
    x = torch.randn(8, 3, 48, 48)
    with torch.inference_mode():
        ref, out = model(x), optimize_for_inference(model, int8=True)(x)
    assert _rel(out, ref) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_residual_add_fused_or_not_is_the_same_linear(dtype: torch.dtype) -> None:
    """AVX2 CPUs have no oneDNN kernel that fuses the residual add into a bf16 output: the add then runs
    after the GEMM. Both forms must compute x @ W^T + b + other."""
    torch.manual_seed(0)
    lin, x, other = torch.nn.Linear(64, 32), torch.randn(10, 64), torch.randn(10, 32)
    ref = lin(x) + other
    fused, unfused = Int8Linear(lin, dtype, "add", rows=10), Int8Linear(lin, dtype, "add", rows=10)
    unfused.fuse_add = False
    with torch.inference_mode():
        a, b = fused(x.to(dtype), other.to(dtype)), unfused(x.to(dtype), other.to(dtype))
    assert a.dtype == b.dtype == dtype
    assert _rel(a, ref) < 0.03 and _rel(b, ref) < 0.03
    assert _rel(a, b) < 0.01


def test_activations_use_7_bits_without_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(50, 64) * 3
    q, scale, zero = int8.quantize_dynamic_u7(x)
    assert q.max() <= 127 and q.min() == 0
    assert ((q.float() - zero) * scale - x).abs().max() <= scale / 2 + 1e-6
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "fma"})
    assert int8.default_quantizer() is int8.quantize_dynamic_u7
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "avx512_vnni"})
    assert int8.default_quantizer() is int8.quantize_dynamic_u8


def test_the_model_is_left_untouched_and_bad_options_fail() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimize_for_inference(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        optimize_for_inference(model, torch.float16)
    with pytest.raises(ValueError, match="int8"):
        optimize_for_inference(model, int8=True, compile=True)


@pytest.mark.slow
def test_compiled_fast_path_matches_the_model() -> None:
    """compile=True: the unpacked fused forward under torch.compile (inductor, weight freezing on CPU); an empty
    batch too."""
    model = _model(depth=2)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():  # inductor's weight freezing does not accept inference-mode tensors
        ref = model(x)
        fast = optimize_for_inference(model, torch.float32, compile=True)
        out = fast(x)
        assert fast(x[:0]).shape == (0, 11)
    assert _rel(out, ref) < 1e-4


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("size", [48, 64])
def test_an_empty_batch_gives_the_models_empty_result(precision: str, size: int) -> None:
    """The model answers an empty batch with (0, K) logits and (0, T, D) tokens; every fast path divided by
    the batch size (ZeroDivisionError, issue 25 item 11). At the model's own size (the packed stem) and at
    another (the resampled position embedding)."""
    if precision == "int8" and not int8.has_onednn_int8():
        pytest.skip("int8 inference needs oneDNN's int8 kernels")
    model = _model(classifier="gap") if size == 64 else _model()
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    fast = optimize_for_inference(model, dtype, int8=precision == "int8", batch_size=4)
    x = torch.zeros(0, 3, size, size)
    with torch.inference_mode():
        logits, tokens = fast(x), fast.forward_features(x)  # type: ignore[operator]
        ref_logits, ref_tokens = model(x), model.forward_features(x)
    assert ref_logits.shape == (0, 11) and ref_tokens.shape[0] == 0
    assert logits.shape == ref_logits.shape and logits.dtype == dtype
    assert tokens.shape == ref_tokens.shape and tokens.dtype == dtype
    assert fast(torch.randn(2, 3, size, size)).shape == (2, 11)  # and the next batch is served as before


def test_chunked_explicit_attention_equals_sdpa() -> None:
    """The CPU attention path (chunks of heads, tiny chunks forced here) equals the fused SDPA path."""
    model = _model()
    x = torch.randn(3, 3, 48, 48)
    fast = InferenceViT(model, torch.float32, rows=None)
    with torch.inference_mode():
        blocks = [b for b in fast.blocks if isinstance(b, FastBlock)]
        assert blocks and all(b.explicit_attention for b in blocks)
        for b in blocks:
            b.scores_bytes = 1  # one head per chunk
        chunked = fast(x)
        for b in blocks:
            b.explicit_attention = False
        fused = fast(x)
    assert _rel(chunked, fused) < 1e-5


def test_mlp_over_chunks_of_rows_equals_the_whole_mlp() -> None:
    """The CPU path runs each block's MLP over chunks of rows (so its hidden activation stays small):
    forced here to chunks of 7 rows (not a divisor of 3 x 10 tokens), against one pass over all rows."""
    model = _model()
    x = torch.randn(3, 3, 48, 48)
    with torch.inference_mode():
        ref = model(x)
        fast = InferenceViT(model, torch.float32, rows=None)
        blocks = [b for b in fast.blocks if isinstance(b, FastBlock)]
        for b in blocks:
            b.mlp_bytes = 7 * b.fc1_features * 4  # 7 rows of fp32
        assert chunk_rows(30, blocks[0].fc1_features * 4, blocks[0].mlp_bytes) == 6  # 5 equal chunks
        chunked = fast(x)
        for b in blocks:
            b.mlp_bytes = 0
        whole = fast(x)
    assert _rel(chunked, whole) < 1e-6
    assert _rel(chunked, ref) < 1e-5
