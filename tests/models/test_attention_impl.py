"""The explicit (unfused) attention path computes the same function and gradients as fused SDPA."""

from __future__ import annotations

import torch

from helpers import randomize_
from vitkit.models import create_model


def test_unfused_attention_same_outputs_and_gradients() -> None:
    model = randomize_(create_model("Ti/16", num_classes=5, image_size=32, depth=2))
    x = torch.randn(3, 3, 32, 32)
    grads = []
    outs = []
    for fused in (True, False):
        model.set_fused_attention(fused)
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(model.blocks[0].attn.qkv.weight.grad.clone())  # type: ignore[union-attr]
    assert not model.blocks[1].attn.fused  # type: ignore[union-attr]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)  # fp32 summation order differs
    assert grads[0].abs().max() > 0
