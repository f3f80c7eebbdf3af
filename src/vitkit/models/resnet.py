"""The ResNet stem of the hybrid models (paper sec. 3.1), as in ``vit_jax/models_resnet.py`` and ``models_vit.py``.

A hybrid ViT feeds the feature map of a (partial) ResNet to the transformer instead of raw pixels; the
"patch embedding" becomes a ``patch_size`` x ``patch_size`` convolution on that map (1 x 1 for most hybrids).

Faithful to the official definition:

- root: weight-standardised 7 x 7 conv, stride 2 -> GroupNorm -> ReLU -> 3 x 3 max-pool, stride 2;
- stage n (``block{n}``) has ``layers[n-1]`` bottleneck units ``unit{m}``, width ``int(64 * wf) * 2^(n-1)``; the
  first stage keeps the resolution, every later one halves it in the 3 x 3 conv of its first unit;
- a unit is conv1 (1 x 1) -> GN -> ReLU -> conv2 (3 x 3, stride) -> GN -> ReLU -> conv3 (1 x 1, 4x width) -> GN,
  added to the input (through conv_proj + gn_proj when the shape changes), then ReLU;
- every conv is a ``StdConv``: kernel standardised per output channel, ``(w - mean) / (std + 1e-5)``
  (population std), no bias; GroupNorm has 32 groups and eps 1e-6 (Flax defaults);
- padding is TensorFlow/Flax "SAME" (asymmetric on even sizes: more padding after than before), also for
  the max-pool, whose padding never wins the max (it is -inf).

Pixels per token along each side: ``2 ** (2 + max(len(layers) - 1, 0)) * patch_size``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.init import lecun_normal_

GN_GROUPS = 32
GN_EPS = 1e-6  # flax.linen.GroupNorm default
WS_EPS = 1e-5  # vit_jax StdConv: weight_standardize(..., eps=1e-5)


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of TF/Flax "SAME": output ceil(size / stride), extra padding goes after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """Pad (B, C, H, W) so a VALID window op of this kernel and stride computes the "SAME" result."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """Convolution with weight standardisation and "SAME" padding, no bias (official ``StdConv``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=False)

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight  # (out, in, kh, kw): statistics over (in, kh, kw) per output channel
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, correction=0)
        return (w - mean) / (std + WS_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        return F.conv2d(pad_same(x, k, s), self.standardized_weight(), None, s)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GN_GROUPS, channels, eps=GN_EPS)


class Bottleneck(nn.Module):
    """Official ``ResidualUnit``: 1x1 -> 3x3 (strided) -> 1x1 (4x width), post-activation, projection if needed."""

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = StdConv2d(in_channels, width, 1)
        self.gn1 = group_norm(width)
        self.conv2 = StdConv2d(width, width, 3, stride)
        self.gn2 = group_norm(width)
        self.conv3 = StdConv2d(width, out, 1)
        self.gn3 = group_norm(out)
        self.conv_proj: StdConv2d | None = None
        self.gn_proj: nn.GroupNorm | None = None
        if in_channels != out or stride != 1:
            self.conv_proj = StdConv2d(in_channels, out, 1, stride)
            self.gn_proj = group_norm(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C_in, H, W) -> (B, 4 * width, H / stride, W / stride)
        residual = x
        if self.conv_proj is not None and self.gn_proj is not None:
            residual = self.gn_proj(self.conv_proj(x))
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(residual + y)


class ResNetStem(nn.Module):
    """Root block plus ``len(layers)`` stages; ``layers=()`` is the root alone (R+Ti/16)."""

    def __init__(self, layers: tuple[int, ...], width_factor: float = 1, in_channels: int = 3) -> None:
        super().__init__()
        width = resnet_root_width(width_factor)
        self.conv_root = StdConv2d(in_channels, width, 7, stride=2)
        self.gn_root = group_norm(width)
        channels = width
        stages: list[tuple[str, nn.Module]] = []
        for n, depth in enumerate(layers):
            stage_width, units = width * 2**n, []
            for m in range(depth):
                stride = 2 if (n > 0 and m == 0) else 1
                units.append((f"unit{m + 1}", Bottleneck(channels, stage_width, stride)))
                channels = 4 * stage_width
            stages.append((f"block{n + 1}", nn.Sequential(OrderedDict(units))))
        self.stages = nn.Sequential(OrderedDict(stages))
        self.out_channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, H, W) -> (B, out_channels, H / reduction, W / reduction)
        x = F.relu(self.gn_root(self.conv_root(x)))
        x = F.max_pool2d(pad_same(x, 3, 2, value=-math.inf), kernel_size=3, stride=2)
        return self.stages(x)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Flax defaults: LeCun-normal conv kernels; GroupNorm scale 1, bias 0; the last GN of a unit scale 0."""
        for m in self.modules():
            if isinstance(m, StdConv2d):
                lecun_normal_(m.weight)
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.gn3.weight)


class HybridEmbed(nn.Module):
    """ResNet stem, then a ``patch_size`` conv (with bias, official name ``embedding``) to D channels."""

    def __init__(
        self, layers: tuple[int, ...], width_factor: float, patch_size: int, in_channels: int, dim: int
    ) -> None:
        super().__init__()
        self.resnet = ResNetStem(layers, width_factor, in_channels)
        self.patch_size = patch_size
        self.proj = nn.Conv2d(self.resnet.out_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, H, W)
        x = self.proj(self.resnet(x))  # (B, D, H / stride, W / stride)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)

    @torch.no_grad()
    def init_weights(self) -> None:
        self.resnet.init_weights()
        lecun_normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)  # type: ignore[arg-type]


def resnet_root_width(width_factor: float) -> int:
    """Channels of the root conv: ``int(64 * width_factor)`` as in vit_jax's ``models_vit.py`` (any factor whose
    width the 32-group GroupNorm divides, e.g. 0.5 -> 32); stage n is ``2^(n-1)`` times as wide."""
    return int(64 * width_factor)


def resnet_reduction(layers: tuple[int, ...]) -> int:
    """Downsampling of a stem with these stages (without the patch conv): root conv and pool 4, later stages 2."""
    return 2 ** (2 + max(len(layers) - 1, 0))
