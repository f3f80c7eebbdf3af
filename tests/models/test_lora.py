"""LoRA adapters (vitkit's own layer, peft's names and semantics): merged = unmerged, the right layers adapted,
and the training kernels' fused Linear path running the adapters instead of silently skipping them: the same
function and gradients as the real peft package's layer, with nothing kept for the frozen base. Interop with peft
itself (state-dict names, A's draw from a seed, the adapter folders both ways): tests/models/test_lora_peft.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vitkit
from vitkit.models import create_model
from vitkit.models.fused import NormInput, TorchKernels
from vitkit.models.kernel_paths import set_fused_attention, set_training_kernels
from vitkit.models.lora import (
    LoraLinear,
    LoraSpec,
    adapted_layers,
    adapter_state,
    add_lora,
    fused_lora,
    load_adapter_state,
    merge_lora,
)
from vitkit.models.vit import VisionTransformer, ViTConfig


@pytest.fixture
def peft() -> object:
    """The real peft package: the reference (skipped where it is not installed)."""
    return pytest.importorskip("peft")


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
    adapted = sorted(name for name, m in model.named_modules() if isinstance(m, LoraLinear))
    assert adapted == ["blocks.0.attn.qkv", "blocks.0.mlp.fc2", "blocks.1.attn.qkv", "blocks.1.mlp.fc2"]
    assert type(model.patch_embed.proj) is nn.Conv2d  # "proj" never matches the patch embedding
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if ".lora_" in n} | {"head.weight", "head.bias"}
    assert "blocks.0.attn.qkv.lora_A.default.weight" in trainable and len(trainable) == 2 * 4 + 2
    a = model.blocks[0].attn.qkv.lora_A["default"].weight
    assert a.shape == (4, 32) and adapted_layers(model) != []


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
    assert adapted_layers(base) == [] and type(base.blocks[0].mlp.fc1) is nn.Linear
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
        set_training_kernels(model, kern)
        set_fused_attention(model, False)  # the explicit attention, which the kernels also take
        base = tiny()
        set_training_kernels(base, kern)
        set_fused_attention(base, False)
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
    set_training_kernels(model, kern)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 3, 16, 16))
    assert len(calls) == 2 * 4  # qkv, proj, fc1 (with GELU), fc2 in each of the 2 blocks
    calls.clear()
    adapted = add_lora(tiny(), LoraSpec(rank=2, targets=("qkv",)))
    set_training_kernels(adapted, kern)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapted(torch.randn(2, 3, 16, 16))
    assert len(calls) == 2 * 4  # the adapted qkv keeps the GEMM too, its adapter beside it (fused.lora_linear)


def layer_pair(peft: Any, d_in: int, d_out: int, dropout: float = 0.0) -> tuple[nn.Module, LoraLinear]:
    """peft's ``lora.Linear`` (rank 4, alpha 8) around a random Linear with a nonzero B, and vitkit's
    :class:`LoraLinear` holding the same W, b, A, B (frozen base, as ``add_lora`` leaves it)."""
    torch.manual_seed(1)
    holder = nn.Module()
    holder.fc = nn.Linear(d_in, d_out)
    cfg = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=dropout, target_modules=["fc"], bias="none")
    peft.inject_adapter_in_model(cfg, holder)
    ref = holder.fc
    with torch.no_grad():
        ref.lora_B["default"].weight.normal_(std=0.3)
    ref.base_layer.requires_grad_(False)
    ours = LoraLinear(copy.deepcopy(ref.base_layer), rank=4, alpha=8.0, dropout=dropout)
    ours.load_state_dict(ref.state_dict())  # the same names: base_layer.*, lora_A.default.weight, ...
    assert ours.scaling == ref.scaling and type(ours.lora_dropout["default"]) is type(ref.lora_dropout["default"])
    return ref, ours


def grads(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    return list(torch.autograd.grad(out, [x, *params], g))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_layer_equals_peft_forward_and_gradients(peft: Any, dropout: float, autocast: bool) -> None:
    """vitkit's layer without kernels (the fallback path) against peft's ``lora.Linear`` on the same W, b, A, B
    (dropout: the same mask from one seed), in fp32 and under bf16 autocast: the same ops, so equal results."""
    ref, ours = layer_pair(peft, 24, 40, dropout)
    x = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 40)
    results = []
    for layer in (ref, ours):
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer.train()(x)
        results.append((out, grads(layer, x, out, g)))
    (want, want_grads), (got, got_grads) = results
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_fused_layer_equals_peft_forward_and_gradients(peft: Any, gelu: bool, dropout: float) -> None:
    """``fused_lora`` on vitkit's layer against peft's own forward on the same W, b, A, B (dropout: the same mask
    from one seed), in fp32 on PyTorch's ops: output and the gradients of x, A and B to fp32 rounding; no
    gradient for the base."""
    ref, ours = layer_pair(peft, 24, 40, dropout)
    ref.train(), ours.train()
    x = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 40)
    torch.manual_seed(7)
    want = ref(x)
    want = nn.functional.gelu(want) if gelu else want
    want_grads = grads(ref, x, want, g)
    torch.manual_seed(7)
    got = fused_lora(ours, x, TorchKernels(), gelu=gelu)
    assert got is not None and (got[1] is not None) == gelu
    got_grads = grads(ours, x, got[0], g)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.base_layer.weight.grad is None and ours.base_layer.bias.grad is None


def kept_shapes(params: set[int]) -> tuple[list[tuple[int, ...]], set[int], Any]:
    """A saved-tensors hook recording what the autograd graph keeps (parameters not counted)."""
    kept: list[tuple[int, ...]] = []
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            kept.append(tuple(t.shape))
            storages.add(t.untyped_storage().data_ptr())
        return t

    return kept, storages, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def test_the_fused_layer_keeps_only_the_adapters_inputs(peft: Any) -> None:
    """What the backward pass keeps: the adapter's input and x A^T (and GELU's input), never a copy of the frozen
    weight; a layer whose input is GELU of a kept tensor (``source``) keeps that instead of its input."""
    (ref1, fc1), (ref2, fc2) = layer_pair(peft, 16, 64), layer_pair(peft, 64, 16)
    x = torch.randn(2, 8, 16)
    kept, storages, hooks = kept_shapes({p.data_ptr() for m in (fc1, fc2) for p in m.parameters()})
    with hooks:
        out = fused_lora(fc1, x, TorchKernels(), gelu=True)
        assert out is not None
        h, pre = out
        y = fused_lora(fc2, h, TorchKernels(), source=pre)
    assert sorted(kept) == sorted([(16, 16), (16, 4), (16, 64), (16, 64), (16, 4)]), kept  # x, xA, h; h, hA
    assert len(storages) == 4  # fc1's GELU input is fc2's: kept once
    assert y is not None and pre is not None
    y[0].sum().backward()
    reference = ref2(nn.functional.gelu(ref1(x)))  # peft's layers, unfused
    torch.testing.assert_close(y[0], reference, rtol=1e-5, atol=1e-6)
    assert fc1.lora_A["default"].weight.grad is not None and fc1.base_layer.weight.grad is None


@pytest.mark.parametrize("gelu", [False, True])
def test_an_input_recomputed_from_its_layernorm_gives_the_same_gradients(peft: Any, gelu: bool) -> None:
    """qkv's and fc1's input is a LayerNorm's output, whose input the LayerNorm's backward keeps anyway: given it
    (``norm``), the adapter keeps that instead of its (N, D) bf16 input, and recomputes the input in the backward
    pass by the same ops and casts, so under bf16 autocast every gradient is bitwise the one of keeping it; and
    both are peft's layer after the same LayerNorm, to bf16 rounding."""
    ref, ours = layer_pair(peft, 24, 40)
    ln = nn.LayerNorm(24, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2), ln.bias.normal_(std=0.2)
    ln.requires_grad_(False)  # frozen, as under LoRA: the LayerNorm keeps its input for its input's gradient
    z = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 40)
    params = {p.data_ptr() for p in ours.parameters()} | {p.data_ptr() for p in ln.parameters()}
    results = {}
    for name in ("keep", "recompute", "peft"):
        kept, _, hooks = kept_shapes(params)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            x = ln(z)
            if name == "peft":
                out = ref(x)
                out = nn.functional.gelu(out) if gelu else out
            else:
                norm = NormInput(z, ln.weight, ln.bias, ln.eps) if name == "recompute" else None
                fused = fused_lora(ours, x, TorchKernels(), gelu=gelu, norm=norm)
                assert fused is not None
                out = fused[0]
        layer = ref if name == "peft" else ours
        got = torch.autograd.grad(out, [z, layer.lora_A["default"].weight, layer.lora_B["default"].weight], g)
        results[name] = (out, got, kept)
    (y0, g0, kept0), (y1, g1, kept1) = results["keep"], results["recompute"]
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert (15, 24) in kept0 and (15, 24) not in kept1  # the bf16 adapter input: kept, then not
    assert kept1.count((3, 5, 24)) == kept0.count((3, 5, 24)) + 1  # the LayerNorm's input, kept by it anyway
    y2, g2, _ = results["peft"]
    torch.testing.assert_close(y1.float(), y2.float(), rtol=0.02, atol=0.02)
    for a, b in zip(g1, g2, strict=True):
        assert (a.float() - b.float()).norm() / b.float().norm() < 0.02


def test_the_fused_path_leaves_other_layers_to_their_own_forward(peft: Any) -> None:
    """A plain Linear, peft's own layer, or a base being trained: the layer's own forward."""
    ref, layer = layer_pair(peft, 8, 8)
    x = torch.randn(2, 8)
    assert fused_lora(nn.Linear(8, 8), x, TorchKernels()) is None
    assert fused_lora(ref, x, TorchKernels()) is None
    assert fused_lora(layer, x, TorchKernels()) is not None
    layer.base_layer.weight.requires_grad_(True)
    assert fused_lora(layer, x, TorchKernels()) is None


def test_the_blocks_recompute_qkv_and_fc1_inputs_from_their_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a model with the training kernels under bf16 autocast, adapted qkv and fc1 keep the LayerNorm's input
    (kept anyway, from the second block on) instead of their own: less kept, every gradient bitwise unchanged
    (the run without ``Block``'s norm inputs is the path that keeps them)."""
    from vitkit.models import kernel_paths
    from vitkit.train import kernels as train_kernels

    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    results = []
    for recompute in (False, True):
        if not recompute:
            monkeypatch.setattr(kernel_paths, "norm_input", lambda norm, x: None)
        else:
            monkeypatch.undo()
        model = add_lora(tiny(), LoraSpec(rank=4), seed=0)
        randomize_adapters(model)
        set_training_kernels(model, train_kernels.load() or TorchKernels())
        set_fused_attention(model, False)
        kept, _, hooks = kept_shapes({p.data_ptr() for p in model.parameters()})
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        results.append(({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, kept))
    (g0, kept0), (g1, kept1) = results
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    tokens = 4 * 17  # batch x (16 patches + the class token)
    assert kept0.count((tokens, 32)) - kept1.count((tokens, 32)) == 3  # block 0's fc1, block 1's qkv and fc1


NO_PEFT = """
import sys
import torch
import vitkit
from vitkit.checkpoints.loaded import state_digest
from vitkit.checkpoints.lora_format import save
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.models import create_model
from vitkit.models.fused import TorchKernels
from vitkit.models.kernel_paths import set_fused_attention, set_training_kernels
from vitkit.models.lora import LoraSpec, add_lora, merge_lora
from vitkit.train import kernels

out = sys.argv[1]
torch.manual_seed(0)
model = create_model("Ti/16", patch_size=4, image_size=16, hidden_size=32, depth=2, num_heads=2, mlp_dim=64,
                     num_classes=3)
base = vitkit.save_pretrained(model, out + "/base", preprocess=Preprocess(image_size=16))
digest = state_digest(vitkit.load_checkpoint(base).model.state_dict())
spec = LoraSpec(rank=2)
add_lora(model, spec, seed=0)
set_training_kernels(model, kernels.load() or TorchKernels())
set_fused_attention(model, False)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)).float(), torch.tensor([0, 1, 2, 0]))
loss.backward()
opt.step()
set_training_kernels(model, None)
save(model, out + "/adapters", base=str(base), base_digest=digest, spec=spec)
merge_lora(model)
vitkit.load_checkpoint(out + "/adapters")
print(sorted(m for m in ("peft", "transformers") if m in sys.modules))
"""


def test_training_merging_and_loading_never_import_peft(tmp_path: Path) -> None:
    """peft imports transformers (about 150 MiB of memory): adding adapters, a step on the fused path, merging,
    saving and loading an adapter folder must not import either."""
    env = {**os.environ, "PYTHONPATH": str(Path(vitkit.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", NO_PEFT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
