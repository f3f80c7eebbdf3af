"""The Vision Transformer, as in Dosovitskiy et al. (ICLR 2021) and the official ``vit_jax/models_vit.py``.

Reading order follows the paper:

    z_0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos            (eq. 1)  PatchEmbed, class token, pos-emb
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                          (eq. 2)  Attention inside Block
    z_l  = MLP(LN(z'_l)) + z'_l                                (eq. 3)  Mlp inside Block
    y    = LN(z_L^0)                                           (eq. 4)  final norm, pooling, head

Shapes use B = batch, C = channels, H x W = image, P = patch, N = number of patches, T = tokens (N plus
the class token when there is one), D = width, h = heads, d = D / h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.config import ViTConfig as ViTConfig  # re-exported: the model's description, beside it
from vitkit.models.config_checks import MAX_CLASSES as MAX_CLASSES  # re-exported: read here by data and knn
from vitkit.models.init import lecun_normal_
from vitkit.models.layers import DropPath, LayerScale, MapHead, Mlp
from vitkit.models.posembed import resample_grid, sincos_2d
from vitkit.models.resnet import HybridEmbed
from vitkit.models.rope import apply_rope, eva_rope_tables, rope_tables

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (N, d): RoPE tables of a patch grid (models/rope.py)

# --------------------------------------------------------------------------------------------------
# Eq. 1: patches -> tokens
# --------------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Cut the image into P x P patches and project each to D dims: a P x P convolution with stride P."""

    def __init__(self, patch_size: int, in_channels: int, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, H, W)
        x = self.proj(x)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)


# --------------------------------------------------------------------------------------------------
# Eq. 2 and 3: the pre-LN transformer block
# --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention, q/k/v computed by one fused Linear(D, 3D).

    The default path calls the fused ``scaled_dot_product_attention``. With ``return_attention=True`` the
    same weights go through an explicit softmax(q k^T / sqrt(d)) v that also returns the probabilities
    (B, h, T, T); both paths compute the same function. ``fused = False`` selects the explicit softmax for
    every call (in the activation dtype; ``vitkit.models.kernel_paths.set_fused_attention`` also gives it its
    own backward pass, which on CPU trains faster than the fused kernel at ViT's short sequences).

    ``key_bias=False`` (DINOv3): the qkv Linear has no bias and the query and value biases are the parameters
    ``q_bias`` and ``v_bias`` (the key's is zero). ``rope``: RoPE tables rotate q and k of the patch tokens
    (the last N of the T) before the scores. ``norm_eps``: a LayerNorm (``norm``) on the merged heads before
    ``proj`` (EVA-CLIP's ``scale_attn_inner``, vitkit's ``attn_norm``); None: none.
    """

    fused: bool = True

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attention_dropout: float = 0.0,
        key_bias: bool = True,
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias and key_bias)
        self.q_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias and not key_bias else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias and not key_bias else None
        self.norm = None if norm_eps is None else nn.LayerNorm(dim, eps=norm_eps)
        self.proj = nn.Linear(dim, dim)

    def qkv_bias(self) -> torch.Tensor | None:
        """The bias of the (3D) projection: qkv's own, or [q_bias; 0; v_bias] without a key bias."""
        if self.q_bias is None or self.v_bias is None:
            return self.qkv.bias
        return torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> q, k, v side by side (B, T, 3D)."""
        qkv = self.qkv(x)
        return qkv if self.q_bias is None else qkv + self.qkv_bias().to(qkv.dtype)  # type: ignore[union-attr]

    def forward(
        self, x: torch.Tensor, return_attention: bool = False, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, T, D) -> (B, T, D) and, with ``return_attention``, the probabilities (B, h, T, T)."""
        out, probs = self.attend(self.project(x), return_attention, rope)  # qkv: (B, T, 3D)
        return self.proj(out if self.norm is None else self.norm(out)), probs

    def attend(
        self, qkv: torch.Tensor, return_attention: bool = False, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q k^T / sqrt(d)) v of every head from the projection (B, T, 3D), merged to (B, T, D)."""
        B, T, three_d = qkv.shape
        p_drop = self.attention_dropout if self.training else 0.0
        qkv = qkv.reshape(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, h, T, d)
        if rope is not None:
            q, k = rotate_patches(q, rope), rotate_patches(k, rope)
        probs = None
        if return_attention:
            logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, T, T)
            probs = logits.float().softmax(dim=-1).to(q.dtype)
            out = F.dropout(probs, p_drop, self.training) @ v  # (B, h, T, d)
        elif not self.fused:
            logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, T, T)
            out = F.dropout(logits.softmax(dim=-1), p_drop, self.training) @ v  # (B, h, T, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop)  # (B, h, T, d)
        return out.transpose(1, 2).reshape(B, T, three_d // 3), probs  # (B, T, D)


def rotate_patches(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """q or k (B, h, T, d) with its last N tokens (the patches; N = the tables' rows) rotated by RoPE."""
    cos, sin = rope
    prefix = x.shape[-2] - cos.shape[0]
    return torch.cat([x[..., :prefix, :], apply_rope(x[..., prefix:, :], cos, sin)], dim=-2)


class BlockPath(Protocol):
    """Another route through a block's two branches, computing the same functions: ``attention`` is
    MSA(LN(x)) (and the probabilities with ``return_attention``), ``mlp`` is MLP(LN(x)). The training step's
    kernels and LoRA's fused layers plug in here, beside the model (``vitkit.models.kernel_paths``)."""

    def attention(
        self, block: Block, x: torch.Tensor, return_attention: bool, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor: ...


class Block(nn.Module):
    """Pre-LN encoder block: z' = z + MSA(LN(z)); z'' = z' + MLP(LN(z')) (paper eqs. 2-3), each branch scaled
    per channel first where the config has ``layer_scale`` (``ls1``, ``ls2``; identity otherwise).

    ``path``: None runs both branches through the block's own modules; a :class:`BlockPath` (set by
    ``vitkit.models.kernel_paths``) runs them its way; the residuals, layer scale, dropout and drop-path stay here."""

    path: BlockPath | None = None

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.norm1 = nn.LayerNorm(D, eps=eps)
        inner = eps if cfg.attn_norm else None  # EVA-CLIP's LayerNorm before the output projection
        self.attn = Attention(D, cfg.num_heads, cfg.qkv_bias, cfg.attention_dropout, cfg.key_bias, inner)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(D, eps=eps)
        self.mlp = Mlp(D, cfg.mlp_dim, cfg.gelu, cfg.dropout, cfg.mlp, eps if cfg.mlp_norm else None)
        scaled = cfg.layer_scale is not None
        self.ls1: nn.Module = LayerScale(D, cfg.layer_scale) if scaled else nn.Identity()  # type: ignore[arg-type]
        self.ls2: nn.Module = LayerScale(D, cfg.layer_scale) if scaled else nn.Identity()  # type: ignore[arg-type]
        self.drop_path = DropPath(drop_path)

    def forward(
        self, x: torch.Tensor, return_attention: bool = False, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # x: (B, T, D)
        path = self.path
        if path is None:
            y, probs = self.attn(self.norm1(x), return_attention, rope)
        else:
            y, probs = path.attention(self, x, return_attention, rope)
        x = x + self.drop_path(self.ls1(self.drop(y)))
        y = self.mlp(self.norm2(x)) if path is None else path.mlp(self, x)
        x = x + self.drop_path(self.ls2(y))
        return x, probs


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass
class Intermediates:
    """What ``forward_intermediates`` returns, for analysis.

    ``hidden_states[i]`` is the input to block i (``hidden_states[0]`` is z_0, after the position
    embedding) and the last entry is the output of the final block before the final norm; ``attentions[i]``
    is block i's attention probabilities (B, h, T, T); ``features`` the final normed tokens (with ``fc_norm``
    the final block's: the norm is on the pooled vector); ``logits`` the head output.
    """

    hidden_states: list[torch.Tensor]
    attentions: list[torch.Tensor]
    features: torch.Tensor
    logits: torch.Tensor


class VisionTransformer(nn.Module):
    """ViT classifier. ``forward(x)`` maps images (B, C, H, W) to logits (B, K).

    Stable API: ``forward_features`` (final normed tokens), ``forward_head`` (pooling, pre-logits, head),
    ``forward``, ``forward_intermediates`` (hidden states and attention of every layer),
    ``resize_image`` (change the resolution, resampling the learned position embedding).

    Images whose size differs from ``cfg.image_size`` are accepted as long as the patch size divides them:
    the position embedding is resampled on the fly (``cfg.pos_resample``; sin-cos and RoPE tables are
    recomputed). The descendants' options (``vitkit.models.config``) are read here and nowhere else in the model.
    """

    pos_table: torch.Tensor  # fixed sin-cos table (buffer) when cfg.pos_embed == "sincos2d"

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        if cfg.resnet_layers is None:
            self.patch_embed: nn.Module = PatchEmbed(cfg.patch_size, cfg.in_channels, D, cfg.patch_bias)
        else:  # hybrid (paper sec. 3.1): ResNet feature map -> patch conv
            self.patch_embed = HybridEmbed(cfg.resnet_layers, cfg.resnet_width, cfg.patch_size, cfg.in_channels, D)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.num_registers, D)) if cfg.num_registers else None
        gh, gw = cfg.grid_size
        self.pos_embed: nn.Parameter | None = None
        if cfg.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_pos_prefix + gh * gw, D))
        elif cfg.pos_embed == "sincos2d":
            self.register_buffer("pos_table", torch.empty(1, gh * gw, D), persistent=False)
        self.norm_pre: nn.Module = nn.LayerNorm(D, eps=cfg.layer_norm_eps) if cfg.norm_pre else nn.Identity()
        self.pos_drop = nn.Dropout(cfg.dropout)
        rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList(Block(cfg, rate) for rate in rates)
        self.norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        map_head = cfg.classifier == "map"
        self.attn_pool = MapHead(D, cfg.num_heads, cfg.mlp_dim, cfg.gelu, cfg.layer_norm_eps) if map_head else None
        proj = cfg.projection_size
        self.projection = nn.Linear(D, proj, bias=False) if proj else None
        rep = cfg.representation_size
        self.pre_logits: nn.Module = nn.Sequential(nn.Linear(D, rep), nn.Tanh()) if rep else nn.Identity()
        width = rep or proj or D
        self.head: nn.Module = nn.Linear(width, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.head_dist: nn.Module | None = None  # DeiT: the distillation token's head
        if cfg.distilled:
            self.head_dist = nn.Linear(width, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        if self.norm.weight.device.type != "meta":  # meta tensors hold no values to initialise, and PyTorch's
            self.init_weights()  # normal_ there goes through its compiler stack (a second of import per command)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Compute the fixed (non-learned) tensors: the sin-cos table when there is one."""
        if self.cfg.pos_embed == "sincos2d":
            self.pos_table = sincos_2d(self.cfg.grid_size, self.cfg.hidden_size, device=self.pos_table.device)

    @property
    def num_features(self) -> int:
        """Width of the representation fed to the head (pre-logits or projection size, or D)."""
        return self.cfg.representation_size or self.cfg.projection_size or self.cfg.hidden_size

    # ---- initialisation --------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """The official initialisation (``vit_jax/models_vit.py`` with Flax defaults).

        - patch conv and pre-logits Dense: LeCun normal (truncated normal, variance 1/fan_in), zero bias;
        - q, k, v and output projections: Xavier uniform, each D x D kernel on its own, zero bias;
        - MLP kernels Xavier uniform, MLP biases normal(std=1e-6) (SwiGLU's gate and up kernels each on its own);
        - class token zeros, learned position embedding normal(std=0.02);
        - LayerNorm scale 1, bias 0; head kernel zeros, head bias ``head_bias_init``.

        The descendants' parts: distillation and register tokens normal(std=0.02) (timm's DeiT), layer scales
        ``cfg.layer_scale``, the MAP head's probe and kernels Xavier uniform (big_vision's ``MAPHead``), CLIP's
        projection normal(std=D^-0.5) (OpenAI's), the distillation head as the head.
        """
        self.init_buffers()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, LayerScale):
                nn.init.constant_(m.gamma, m.init)
            elif isinstance(m, Mlp):
                for i in range(m.fc1.out_features // m.fc2.in_features):  # 1, or gate and up for SwiGLU
                    nn.init.xavier_uniform_(m.fc1.weight[i * m.fc2.in_features : (i + 1) * m.fc2.in_features])
                nn.init.xavier_uniform_(m.fc2.weight)
                nn.init.normal_(m.fc1.bias, std=1e-6)
                nn.init.normal_(m.fc2.bias, std=1e-6)
        stem = self.patch_embed
        if isinstance(stem, PatchEmbed):
            lecun_normal_(stem.proj.weight)
            if stem.proj.bias is not None:
                nn.init.zeros_(stem.proj.bias)
        elif isinstance(stem, HybridEmbed):
            stem.init_weights()
        for token in (self.cls_token, self.dist_token, self.reg_token, self.pos_embed):
            if token is self.cls_token and token is not None:
                nn.init.zeros_(token)
            elif token is not None:
                nn.init.normal_(token, std=0.02)
        D = self.cfg.hidden_size
        for blk in self.blocks:
            assert isinstance(blk, Block)
            for i in range(3):  # q, k, v: Xavier over (D, D) each, as three separate Flax kernels
                nn.init.xavier_uniform_(blk.attn.qkv.weight[i * D : (i + 1) * D])
            for bias in (blk.attn.qkv.bias, blk.attn.q_bias, blk.attn.v_bias, blk.attn.proj.bias):
                if bias is not None:
                    nn.init.zeros_(bias)
            nn.init.xavier_uniform_(blk.attn.proj.weight)
        if self.attn_pool is not None:
            pool = self.attn_pool
            for w in (pool.probe.view(1, D), pool.q.weight, pool.kv.weight[:D], pool.kv.weight[D:], pool.proj.weight):
                nn.init.xavier_uniform_(w)
            for bias in (pool.q.bias, pool.kv.bias, pool.proj.bias):
                nn.init.zeros_(bias)
        if self.projection is not None:
            nn.init.normal_(self.projection.weight, std=D**-0.5)
        if isinstance(self.pre_logits, nn.Sequential):
            dense = self.pre_logits[0]
            assert isinstance(dense, nn.Linear)
            lecun_normal_(dense.weight)
            nn.init.zeros_(dense.bias)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)
                nn.init.constant_(head.bias, self.cfg.head_bias_init)

    # ---- eq. 1 -----------------------------------------------------------------------------------

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> z_0 (B, T, D): ``tokens``, then the pre-norm (CLIP) and dropout."""
        return self.pos_drop(self.norm_pre(self.tokens(x)))

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> [class, distillation, registers, patches] with their position embedding
        (B, T, D): an affine function of the image (the fast path's stem relies on it)."""
        grid = self.grid_of(x)
        return self.add_positions(self.patch_embed(x), grid)  # patches (B, N, D) -> (B, T, D)

    def add_positions(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch tokens (B, N, D) of a grid -> (B, T, D) with the prefix tokens and the position embedding: the
        learned one covers the class/distillation tokens when ``pos_embed_prefix``, registers never (DINOv2);
        the sin-cos table covers only the patches; RoPE models add none here."""
        B, cfg = x.shape[0], self.cfg
        pos: torch.Tensor | None = self.pos_embed
        if pos is not None and grid != cfg.grid_size:
            pos = resample_grid(pos, cfg.grid_size, grid, cfg.num_pos_prefix, cfg.pos_resample)
        elif cfg.pos_embed == "sincos2d":
            pos = self.pos_table if grid == cfg.grid_size else sincos_2d(grid, x.shape[-1], device=x.device)
        lead = [t.expand(B, -1, -1).to(x.dtype) for t in (self.cls_token, self.dist_token) if t is not None]
        if pos is not None and cfg.num_pos_prefix:
            x = torch.cat([*lead, x], dim=1) + pos.to(x.dtype)  # (B, prefix + N, D)
        else:
            x = torch.cat([*lead, x if pos is None else x + pos.to(x.dtype)], dim=1)
        if self.reg_token is not None:  # registers after the class (and distillation) token, no position
            n = len(lead)
            x = torch.cat([x[:, :n], self.reg_token.expand(B, -1, -1).to(x.dtype), x[:, n:]], dim=1)
        return x

    def rope(self, grid: tuple[int, int], device: torch.device | None = None) -> Rope | None:
        """RoPE tables (cos, sin) for a patch grid, or None when the config has no RoPE."""
        cfg = self.cfg
        if cfg.rope == "eva":
            return eva_rope_tables(grid, cfg.head_dim, cfg.rope_theta, cfg.rope_ref_grid, device)
        return None if cfg.rope is None else rope_tables(grid, cfg.head_dim, cfg.rope_theta, device)

    def grid_of(self, x: torch.Tensor) -> tuple[int, int]:
        """Token grid (gh, gw) for images x (B, C, H, W); a clear error when the stride does not divide."""
        if x.ndim != 4 or x.shape[1] != self.cfg.in_channels:
            raise ValueError(f"expected images (B, {self.cfg.in_channels}, H, W), got {tuple(x.shape)}")
        stride = self.cfg.stride
        H, W = x.shape[-2:]
        if H % stride or W % stride:
            raise ValueError(f"image size {H}x{W} is not a multiple of the model's patch stride {stride}")
        return (H // stride, W // stride)

    # ---- eqs. 2-4 --------------------------------------------------------------------------------

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> final normed tokens (B, T, D) (with ``cfg.fc_norm``, not normed)."""
        rope = self.rope(self.grid_of(x), x.device)
        x = self.embed(x)
        for blk in self.blocks:
            x, _ = blk(x, rope=rope)
        return x if self.cfg.fc_norm else self.norm(x)  # fc_norm: the final norm is on the pooled vector

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D): the class token (with DeiT's distillation token, their mean), the mean of the
        patch tokens (GAP), or attention pooling (MAP)."""
        if self.attn_pool is not None:
            return self.attn_pool(tokens)
        if self.cfg.classifier == "gap":
            return tokens[:, self.cfg.num_prefix_tokens :].mean(dim=1)
        return tokens[:, :2].mean(dim=1) if self.cfg.distilled else tokens[:, 0]

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Final tokens (B, T, D) -> logits (B, K), or the representation (B, R) with ``pre_logits=True``
        (pooled, normed with ``fc_norm``, then CLIP's projection or the pre-logits layer). DeiT's logits are the
        mean of its two heads'."""
        if self.head_dist is not None and not pre_logits:
            cls, dist = self.represent(tokens[:, 0]), self.represent(tokens[:, 1])
            return (self.head(cls) + self.head_dist(dist)) / 2
        pooled = self.pool(tokens)  # (B, D)
        x = self.represent(self.norm(pooled) if self.cfg.fc_norm else pooled)  # (B, R)
        return x if pre_logits else self.head(x)

    def represent(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled (B, D) -> the head's input (B, R): CLIP's projection, or the pre-logits layer, or as it is."""
        return self.pre_logits(pooled if self.projection is None else self.projection(pooled))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, attention: bool = True) -> Intermediates:
        """Run the model keeping every block's input/output and (optionally) attention probabilities."""
        rope = self.rope(self.grid_of(x), x.device)
        z = self.embed(x)
        hidden, attns = [z], []
        for blk in self.blocks:
            z, probs = blk(z, return_attention=attention, rope=rope)
            hidden.append(z)
            if probs is not None:
                attns.append(probs)
        feats = z if self.cfg.fc_norm else self.norm(z)
        return Intermediates(hidden, attns, feats, self.forward_head(feats))

    # ---- resolution ------------------------------------------------------------------------------

    @torch.no_grad()
    def resize_image(self, image_size: int | tuple[int, int], method: str | None = None) -> None:
        """Change the model's native resolution in place, resampling the learned position-embedding grid.

        The patch size stays; the sequence grows or shrinks. ``method`` (default ``cfg.pos_resample``):
        ``"bilinear"`` reproduces the official ``interpolate_posembed`` (scipy zoom, order 1); ``"bicubic"`` is
        timm's (antialiased), ``"bicubic_plain"`` transformers', ``"bicubic_offset"`` the official DINOv2 code's (see
        ``resample_grid``).
        """
        new_cfg = self.cfg.replace(image_size=image_size)  # checks that the stride divides the new size
        if self.pos_embed is not None:
            pe = resample_grid(
                self.pos_embed.data,
                self.cfg.grid_size,
                new_cfg.grid_size,
                self.cfg.num_pos_prefix,
                method or self.cfg.pos_resample,
            )
            self.pos_embed = nn.Parameter(pe)
        self.cfg = new_cfg
        self.init_buffers()

    @torch.no_grad()
    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """Replace the head (and DeiT's distillation head) by zero-initialised ones for ``num_classes`` (the
        paper's fine-tuning recipe). The pre-logits layer is dropped unless ``keep_pre_logits``.
        """
        rep = self.cfg.representation_size if keep_pre_logits else None
        if not keep_pre_logits:
            self.pre_logits = nn.Identity()
        width = rep or self.cfg.projection_size or self.cfg.hidden_size
        ref = next(self.parameters())

        def fresh() -> nn.Module:
            if num_classes <= 0:
                return nn.Identity()
            head = nn.Linear(width, num_classes).to(ref.device, ref.dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
            return head

        self.head = fresh()
        if self.head_dist is not None:
            self.head_dist = fresh()
        self.cfg = self.cfg.replace(num_classes=num_classes, representation_size=rep, head_bias_init=0.0)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable and frozen parameters (buffers such as sin-cos tables excluded)."""
    return sum(p.numel() for p in model.parameters())
