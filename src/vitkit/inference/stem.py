"""The patch embedding of the CPU inference fast path as one pre-packed GEMM: ``PackedStem``.

The model's stem is a P x P convolution of stride P, then the class token and the position embedding
(``VisionTransformer.embed``). At the model's own image size that is an affine map of the image's patches:
z = [prefix rows; patches W^T + b] + pos, with W the convolution's weight as a (D, C P P) matrix. Here the
patches are cut out of the image and cast to the serving dtype in one copy, multiplied by W through
``PackedLinear`` (oneDNN, weight packed once for the batch size, bias in the epilogue), and the position
embedding is added while the result is written into the token matrix; the prefix rows (class token, plus its
position embedding where it has one) are a constant. The constant parts are taken from the model's own
``tokens`` run on a zero image with a zero bias (in fp32, before the cast), so every embedding variant
(learned or sin-cos, class token or GAP) gets them as the model defines them. Other image sizes (the position
embedding is resampled there) go to the model's ``embed``, and so do hybrid models (their stem is a ResNet
before the projection: ``PackedStem.handles``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from vitkit.models.vit import PatchEmbed, VisionTransformer


class PackedStem(nn.Module):
    """``embed(images) -> (B*T, D)`` tokens in ``dtype`` (see the module docstring); ``linear`` is the
    ``PackedLinear`` class of the fast path (passed in: this module sits below ``fast``)."""

    @staticmethod
    def handles(model: VisionTransformer) -> bool:
        """Whether the model's stem is the plain patch projection this replaces (not a hybrid's ResNet)."""
        return isinstance(model.patch_embed, PatchEmbed)

    def __init__(self, model: VisionTransformer, dtype: torch.dtype, rows: int | None, linear: type) -> None:
        """``model``: the fast path's own copy of the model, before its cast to ``dtype`` (its patch embedding's
        bias is set to zero for a moment while the constants are taken)."""
        super().__init__()
        if not self.handles(model):
            raise ValueError(f"PackedStem replaces a PatchEmbed, not a {type(model.patch_embed).__name__}")
        cfg = model.cfg
        conv = cast(nn.Conv2d, model.patch_embed.proj)
        D, C, P, _ = conv.weight.shape
        self.dtype, self.patch, self.channels = dtype, P, C
        self.image_size = tuple(cfg.image_size)
        self.prefix = cfg.num_prefix_tokens
        as_linear = nn.Linear(C * P * P, D, bias=conv.bias is not None)
        with torch.no_grad():
            as_linear.weight.copy_(conv.weight.detach().reshape(D, C * P * P))
            conv_bias = conv.bias
            saved = None if conv_bias is None else conv_bias.detach().clone()
            if conv_bias is not None and saved is not None:
                as_linear.bias.copy_(saved)
                conv_bias.zero_()
            try:
                zeros = torch.zeros(1, C, *self.image_size, dtype=conv.weight.dtype, device=conv.weight.device)
                offset = model.tokens(zeros)[0]  # (T, D): the prefix rows, then the patches' position embedding
            finally:
                if conv_bias is not None and saved is not None:
                    conv_bias.copy_(saved)
        patch_rows = None if rows is None else rows // cfg.num_tokens() * (cfg.num_tokens() - self.prefix)
        self.proj = linear(as_linear, dtype, "none", patch_rows)  # packed for the batch's patch rows
        self.offset: torch.Tensor
        self.register_buffer("offset", offset.to(dtype), persistent=False)

    def supports(self, x: torch.Tensor) -> bool:
        return x.dim() == 4 and tuple(x.shape[1:]) == (self.channels, *self.image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, H, W) at the model's image size
        B, C, H, W = x.shape
        P, prefix = self.patch, self.prefix
        gh, gw = H // P, W // P
        patches = torch.empty(B, gh, gw, C, P, P, dtype=self.dtype, device=x.device)
        patches.copy_(x.view(B, C, gh, P, gw, P).permute(0, 2, 4, 1, 3, 5))  # cut and cast in one copy
        y = self.proj(patches.view(B * gh * gw, C * P * P))  # (B*N, D)
        T, D = gh * gw + prefix, y.shape[1]
        z = torch.empty(B, T, D, dtype=y.dtype, device=y.device)
        if prefix:
            z[:, :prefix] = self.offset[:prefix]
        torch.add(y.view(B, gh * gw, D), self.offset[prefix:], out=z[:, prefix:])
        return z.view(B * T, D)
