"""Activation checkpointing (grad_checkpointing=True): the recomputed backward gives the same gradients."""

from __future__ import annotations

import copy

import torch

from vitkit import create_model
from vitkit.models.vit import ViTConfig
from vitkit.train.parallel import checkpoint_activations


def test_checkpointed_blocks_give_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = create_model(
        ViTConfig(), patch_size=4, image_size=16, hidden_size=32, depth=3, num_heads=2, mlp_dim=64, num_classes=5
    ).train()
    torch.nn.init.normal_(plain.head.weight, std=0.1)  # a zero head would give the blocks zero gradients
    ckpt = checkpoint_activations(copy.deepcopy(plain))
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    grads = []
    for net in (plain, ckpt):
        calls: list[int] = []
        hook = net.blocks[1].norm1.register_forward_hook(lambda *_, c=calls: c.append(1))
        torch.nn.functional.cross_entropy(net(x), y).backward()
        hook.remove()
        grads.append({n: p.grad for n, p in net.named_parameters()})
        assert len(calls) == (2 if net is ckpt else 1)  # the block really ran again in the backward pass
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
