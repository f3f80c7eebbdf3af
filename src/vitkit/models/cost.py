"""Parameter and compute accounting for a ViT: per-component parameter counts and multiply-adds.

MACs count the matrix products (patch projection, q/k/v, attention scores, attention-weighted values,
output projection, MLP, pre-logits, head); element-wise work (LayerNorm, softmax, GELU, residual adds)
is left out, as in the paper and the usual FLOP tables. FLOPs = 2 x MACs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitkit.models.vit import Block, VisionTransformer


@dataclass(frozen=True)
class Row:
    component: str
    params: int
    macs: int


def _params(module: nn.Module | nn.Parameter | None) -> int:
    if module is None:
        return 0
    if isinstance(module, nn.Parameter):
        return module.numel()
    return sum(p.numel() for p in module.parameters())


def cost_table(model: VisionTransformer, image_size: tuple[int, int] | None = None) -> list[Row]:
    """One row per component, for one image at ``image_size`` (default: the model's own)."""
    cfg = model.cfg
    H, W = image_size or cfg.image_size
    T = cfg.num_tokens((H, W))
    D, M, L = cfg.hidden_size, cfg.mlp_dim, cfg.depth
    stem_macs = stem_mac_count(model.patch_embed, (H, W), cfg.in_channels)
    block = model.blocks[0]
    assert isinstance(block, Block)
    attn_macs = T * D * 3 * D + 2 * T * T * D + T * D * D  # qkv, q k^T, attn v, out projection
    mlp_macs = 2 * T * D * M
    rows = [
        Row("patch embedding", _params(model.patch_embed), stem_macs),
        Row("class token", _params(model.cls_token), 0),
        Row("position embedding", _params(model.pos_embed), 0),
        Row(f"blocks: attention (x{L})", L * (_params(block.attn) + _params(block.norm1)), L * attn_macs),
        Row(f"blocks: MLP (x{L})", L * (_params(block.mlp) + _params(block.norm2)), L * mlp_macs),
        Row("final norm", _params(model.norm), 0),
    ]
    R = cfg.representation_size
    if isinstance(model.pre_logits, nn.Sequential) and R:
        rows.append(Row("pre-logits", _params(model.pre_logits), D * R))
    if cfg.num_classes > 0:
        rows.append(Row("head", _params(model.head), (R or D) * cfg.num_classes))
    return rows


def stem_mac_count(stem: nn.Module, image_size: tuple[int, int], in_channels: int = 3) -> int:
    """MACs of the stem (patch conv, or a hybrid's ResNet plus patch conv) for one image.

    Counted by torch's FlopCounterMode on a meta tensor, so any stem architecture is measured exactly and
    without allocating memory.
    """
    x = torch.empty(1, in_channels, *image_size, device="meta")
    meta_stem = copy.deepcopy(stem).to("meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta_stem(x)
    return counter.get_total_flops() // 2
