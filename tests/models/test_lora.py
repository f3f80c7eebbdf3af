"""LoRA adapters through peft: merged = unmerged, the right layers adapted, and the training kernels' fused
Linear path running the adapters instead of silently skipping them: the same function and gradients as peft's
layer, with nothing kept for the frozen base."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vitkit.models import create_model
from vitkit.models.lora import LoraSpec, adapter_state, add_lora, is_adapted, load_adapter_state, merge_lora
from vitkit.models.vit import VisionTransformer, ViTConfig

peft = pytest.importorskip("peft")


def tiny(**overrides: object) -> VisionTransformer:
    torch.manual_seed(0)
    cfg = {"patch_size": 4, "image_size": 16, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
    model = create_model(ViTConfig(), num_classes=5, **{**cfg, **overrides})
    nn.init.normal_(model.head.weight, std=0.2)  # a zero head would hide every change of the features
    return model


def randomize_adapters(model: nn.Module, std: float = 0.1) -> None:
    """LoRA starts with B = 0 (the adapted model equals the base); a trained one does not."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=std)


def test_adapters_go_on_the_chosen_projections_only() -> None:
    model = add_lora(tiny(), LoraSpec(rank=4, targets=("qkv", "fc2")))
    adapted = sorted(name for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear))
    assert adapted == ["blocks.0.attn.qkv", "blocks.0.mlp.fc2", "blocks.1.attn.qkv", "blocks.1.mlp.fc2"]
    assert type(model.patch_embed.proj) is nn.Conv2d  # "proj" never matches the patch embedding
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if ".lora_" in n} | {"head.weight", "head.bias"}
    assert "blocks.0.attn.qkv.lora_A.default.weight" in trainable and len(trainable) == 2 * 4 + 2
    a = model.blocks[0].attn.qkv.lora_A["default"].weight
    assert a.shape == (4, 32) and is_adapted(model)


@pytest.mark.parametrize("targets", [("qkv", "proj", "fc1", "fc2"), ("fc1",)])
def test_merged_forward_equals_unmerged(targets: tuple[str, ...]) -> None:
    model = add_lora(tiny(representation_size=24), LoraSpec(rank=4, alpha=8.0, dropout=0.2, targets=targets))
    randomize_adapters(model)
    x = torch.randn(3, 3, 16, 16)
    model.eval()  # (adapter dropout is off in evaluation, as in every use of a saved model)
    with torch.no_grad():
        unmerged = model(x)
        base = merge_lora(copy.deepcopy(model)).eval()  # merged copy first: `model` keeps its adapters
        merged = base(x)
    assert not is_adapted(base) and type(base.blocks[0].mlp.fc1) is nn.Linear
    assert set(base.state_dict()) == set(tiny(representation_size=24).state_dict())  # a plain ViT again
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = tiny(representation_size=24).eval()(x)
    assert (unmerged - plain).abs().max() > 1e-3  # the adapters do change the function


def test_adapter_state_round_trips_in_peft_names() -> None:
    spec = LoraSpec(rank=2, targets=("qkv", "fc1"))
    src = add_lora(tiny(), spec)
    randomize_adapters(src)
    state = adapter_state(src)
    assert "blocks.1.mlp.fc1.lora_B.weight" in state and all(".default." not in k for k in state)
    dst = add_lora(tiny(), spec)
    load_adapter_state(dst, state, "adapters")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(dst.eval()(x), src.eval()(x))
    with pytest.raises(Exception, match=r"lacks blocks\.0\.attn\.qkv\.lora_A\.weight"):
        load_adapter_state(dst, {k: v for k, v in state.items() if "blocks.0.attn.qkv.lora_A" not in k}, "a")


def test_training_kernels_run_the_adapters_forward_and_backward() -> None:
    """With the CPU training kernels set (bf16 autocast: the path ``vitkit train`` takes on AVX-512 BF16 CPUs),
    the blocks route plain Linear layers through oneDNN's GEMM on ``layer.weight``; an adapted layer must run
    its own forward instead, or its adapters would be skipped: same output and no adapter gradients."""
    from vitkit.models.fused import TorchKernels
    from vitkit.train import kernels as train_kernels

    native = train_kernels.load()
    spec = LoraSpec(rank=4, targets=("qkv", "proj", "fc1", "fc2"))
    x = torch.randn(4, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 3])
    results = {}
    for name, kern in (("none", None), ("torch", TorchKernels()), ("native", native)):
        if name == "native" and kern is None:
            continue  # no C compiler or no AVX-512 BF16 here: the TorchKernels run covers the routing
        model = add_lora(tiny(), spec)
        randomize_adapters(model)
        model.set_training_kernels(kern)
        model.set_fused_attention(False)  # the explicit attention, which the kernels also take
        base = tiny()
        base.set_training_kernels(kern)
        base.set_fused_attention(False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = nn.functional.cross_entropy(out.float(), y)
            with torch.no_grad():
                ref = base(x)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".lora_" in n}
        assert (out.float() - ref.float()).abs().max() > 0.05, name  # the adapters change the output
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), name
        assert all(p.grad is None for n, p in model.named_parameters() if ".base_layer." in n)  # frozen
        results[name] = (out.float().detach(), {n: g.float() for n, g in grads.items()})
    want_out, want_grads = results["none"]
    for name, (got_out, got_grads) in results.items():  # the same function and gradients on every path
        torch.testing.assert_close(got_out, want_out, rtol=0.05, atol=0.05, msg=lambda m, k=name: f"{k}: {m}")
        for n, g in got_grads.items():
            err = (g - want_grads[n]).norm() / want_grads[n].norm()
            assert err < 0.05, (name, n, float(err))


def test_plain_layers_still_take_the_kernels_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The routing change leaves a model without adapters on the kernels' GEMM."""
    from vitkit.models.fused import TorchKernels

    calls: list[int] = []
    kern = TorchKernels()
    original = kern.linear
    monkeypatch.setattr(kern, "linear", lambda x, w, b: calls.append(1) or original(x, w, b))
    model = tiny()
    model.set_training_kernels(kern)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 3, 16, 16))
    assert len(calls) == 2 * 4  # qkv, proj, fc1 (with GELU), fc2 in each of the 2 blocks
    calls.clear()
    adapted = add_lora(tiny(), LoraSpec(rank=2, targets=("qkv",)))
    adapted.set_training_kernels(kern)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapted(torch.randn(2, 3, 16, 16))
    assert len(calls) == 2 * 4  # the adapted qkv keeps the GEMM too, its adapter beside it (fused.lora_linear)


def peft_linear(d_in: int, d_out: int, dropout: float = 0.0) -> nn.Module:
    """One peft ``lora.Linear`` (rank 4, alpha 8) around a random Linear, with a nonzero B."""
    torch.manual_seed(1)
    holder = nn.Module()
    holder.fc = nn.Linear(d_in, d_out)
    cfg = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=dropout, target_modules=["fc"], bias="none")
    peft.inject_adapter_in_model(cfg, holder)
    layer = holder.fc
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.3)
    layer.base_layer.requires_grad_(False)  # add_lora's freezing
    return layer


def grads(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    return list(torch.autograd.grad(out, [x, *params], g))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_fused_layer_equals_peft_forward_and_gradients(gelu: bool, dropout: float) -> None:
    """``fused_lora`` against peft's own forward on the same W, b, A, B (dropout: the same mask from one seed),
    in fp32 on PyTorch's ops: output and the gradients of x, A and B to fp32 rounding; no gradient for the base."""
    from vitkit.models.fused import TorchKernels
    from vitkit.models.lora import fused_lora

    layer = peft_linear(24, 40, dropout).train()
    x = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 40)
    torch.manual_seed(7)
    want = layer(x)
    want = nn.functional.gelu(want) if gelu else want
    want_grads = grads(layer, x, want, g)
    torch.manual_seed(7)
    got = fused_lora(layer, x, TorchKernels(), gelu=gelu)
    assert got is not None and (got[1] is not None) == gelu
    got_grads = grads(layer, x, got[0], g)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert layer.base_layer.weight.grad is None and layer.base_layer.bias.grad is None


def test_the_fused_layer_keeps_only_the_adapters_inputs() -> None:
    """What the backward pass keeps: the adapter's input and x A^T (and GELU's input), never a copy of the frozen
    weight; a layer whose input is GELU of a kept tensor (``source``) keeps that instead of its input."""
    from vitkit.models.fused import TorchKernels
    from vitkit.models.lora import fused_lora

    fc1, fc2 = peft_linear(16, 64), peft_linear(64, 16)
    x = torch.randn(2, 8, 16)
    kept: list[tuple[int, ...]] = []
    storages: set[int] = set()
    params = {p.data_ptr() for m in (fc1, fc2) for p in m.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            kept.append(tuple(t.shape))
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused_lora(fc1, x, TorchKernels(), gelu=True)
        assert out is not None
        h, pre = out
        y = fused_lora(fc2, h, TorchKernels(), source=pre)
    assert sorted(kept) == sorted([(16, 16), (16, 4), (16, 64), (16, 64), (16, 4)]), kept  # x, xA, h; h, hA
    assert len(storages) == 4  # fc1's GELU input is fc2's: kept once
    assert y is not None and pre is not None
    y[0].sum().backward()
    reference = fc2(nn.functional.gelu(fc1(x)))  # peft's layers, unfused
    torch.testing.assert_close(y[0], reference, rtol=1e-5, atol=1e-6)
    assert fc1.lora_A["default"].weight.grad is not None and fc1.base_layer.weight.grad is None


def test_the_fused_path_leaves_other_layers_to_peft() -> None:
    """A merged adapter, adapters switched off, or a base being trained: the layer's own (peft's) forward."""
    from vitkit.models.fused import TorchKernels
    from vitkit.models.lora import fused_lora

    layer = peft_linear(8, 8)
    x = torch.randn(2, 8)
    assert fused_lora(nn.Linear(8, 8), x, TorchKernels()) is None
    assert fused_lora(layer, x, TorchKernels()) is not None
    layer.base_layer.weight.requires_grad_(True)
    assert fused_lora(layer, x, TorchKernels()) is None
    layer.base_layer.weight.requires_grad_(False)
    layer.merge()
    assert fused_lora(layer, x, TorchKernels()) is None
