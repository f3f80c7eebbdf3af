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

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.config_checks import MAX_CLASSES as MAX_CLASSES  # re-exported: read here by data and knn
from vitkit.models.config_checks import check_config, is_int
from vitkit.models.init import lecun_normal_
from vitkit.models.posembed import resample_grid, sincos_2d
from vitkit.models.resnet import HybridEmbed, resnet_reduction

Classifier = Literal["token", "gap"]
PosEmbed = Literal["learned", "sincos2d"]
Gelu = Literal["exact", "tanh"]


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT's architecture (not how it is trained).

    ``image_size`` is (H, W); an int means a square image. Both sides must be multiples of the patch size
    (after the hybrid stem's stride, when there is one).
    """

    image_size: tuple[int, int] = (224, 224)
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000  # 0: no head, the model returns the (pre-logits) representation
    hidden_size: int = 768  # D
    depth: int = 12  # L
    num_heads: int = 12
    mlp_dim: int = 3072
    classifier: Classifier = "token"  # "token": class token; "gap": mean of the final normed tokens
    pos_embed: PosEmbed = "learned"  # "sincos2d": fixed 2-D sin-cos on the patches, none on the token
    representation_size: int | None = None  # pre-logits Dense + tanh, as in pre-training
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0  # stochastic depth rate of the last block (linearly increasing from 0)
    gelu: Gelu = "exact"  # the official JAX code uses "tanh" (jax.nn.gelu's default)
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    head_bias_init: float = 0.0  # -10 for the official ImageNet-21k pre-training heads
    resnet_layers: tuple[int, ...] | None = None  # hybrid: ResNet stage depths, e.g. (3, 4, 9); () = root only
    resnet_width: float = 1  # hybrid: ResNet width factor, int(64 * width) channels in the root (official)
    name: str | None = None  # variant name such as "B/16", informational
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # free-form, kept in checkpoints

    def __post_init__(self) -> None:
        size = self.image_size
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size, size)
        if not (isinstance(size, (tuple, list)) and len(size) == 2 and all(is_int(s) for s in size)):
            raise ValueError(f"invalid ViT config: image_size must be an integer or two, got {size!r}")
        object.__setattr__(self, "image_size", (int(size[0]), int(size[1])))
        if self.resnet_layers is not None:
            layers = self.resnet_layers
            if not (isinstance(layers, (tuple, list)) and all(is_int(n) for n in layers)):
                raise ValueError(f"invalid ViT config: resnet_layers must be a list of integers, got {layers!r}")
            object.__setattr__(self, "resnet_layers", tuple(int(n) for n in layers))
        self.validate()

    def validate(self) -> None:
        """Types, ranges and sizes, checked before anything is allocated (configs come from untrusted files;
        ``vitkit.models.config_checks``)."""
        check_config(self)

    @property
    def stride(self) -> int:
        """Pixels per token along each side: the patch size, times the ResNet's downsampling for hybrids."""
        if self.resnet_layers is None:
            return self.patch_size
        return resnet_reduction(self.resnet_layers) * self.patch_size

    @property
    def grid_size(self) -> tuple[int, int]:
        """Token grid (rows, columns) at the configured image size."""
        return self.grid_at(self.image_size)

    def grid_at(self, image_size: int | tuple[int, int]) -> tuple[int, int]:
        """Token grid (rows, columns) for images of ``image_size`` (H, W; an int means square)."""
        H, W = (image_size, image_size) if isinstance(image_size, int) else image_size
        return (H // self.stride, W // self.stride)

    def num_tokens(self, image_size: int | tuple[int, int] | None = None) -> int:
        """Sequence length T: the patches of the grid plus the class token (default: the configured size)."""
        gh, gw = self.grid_at(self.image_size if image_size is None else image_size)
        return gh * gw + self.num_prefix_tokens

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.classifier == "token" else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        if self.resnet_layers is not None:
            d["resnet_layers"] = list(self.resnet_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ViT config keys: {', '.join(unknown)}")
        d = dict(d)
        for key in ("image_size", "resnet_layers"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Eq. 1: patches -> tokens
# --------------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Cut the image into P x P patches and project each to D dims: a P x P convolution with stride P."""

    def __init__(self, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

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
    """

    fused: bool = True

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, T, D) -> (B, T, D) and, with ``return_attention``, the probabilities (B, h, T, T)."""
        out, probs = self.attend(self.qkv(x), return_attention)  # qkv: (B, T, 3D)
        return self.proj(out), probs

    def attend(self, qkv: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q k^T / sqrt(d)) v of every head from the projection (B, T, 3D), merged to (B, T, D)."""
        B, T, three_d = qkv.shape
        p_drop = self.attention_dropout if self.training else 0.0
        qkv = qkv.reshape(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, h, T, d)
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


class Mlp(nn.Module):
    """Dense(mlp_dim) -> GELU -> dropout -> Dense(D) -> dropout."""

    def __init__(self, dim: int, hidden: int, gelu: Gelu = "exact", dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if gelu == "tanh" else "none")
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D)."""
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: zero a residual branch for a random subset of samples, rescaling the rest."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class BlockPath(Protocol):
    """Another route through a block's two branches, computing the same functions: ``attention`` is
    MSA(LN(x)) (and the probabilities with ``return_attention``), ``mlp`` is MLP(LN(x)). The training step's
    kernels and LoRA's fused layers plug in here, beside the model (``vitkit.models.kernel_paths``)."""

    def attention(
        self, block: Block, x: torch.Tensor, return_attention: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor: ...


class Block(nn.Module):
    """Pre-LN encoder block: z' = z + MSA(LN(z)); z'' = z' + MLP(LN(z')) (paper eqs. 2-3).

    ``path``: None runs both branches through the block's own modules; a :class:`BlockPath` (set by
    ``vitkit.models.kernel_paths``) runs them its way; the residuals, dropout and drop-path stay here."""

    path: BlockPath | None = None

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.norm1 = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.attn = Attention(D, cfg.num_heads, cfg.qkv_bias, cfg.attention_dropout)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(D, cfg.mlp_dim, cfg.gelu, cfg.dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        # x: (B, T, D)
        path = self.path
        if path is None:
            y, probs = self.attn(self.norm1(x), return_attention)
        else:
            y, probs = path.attention(self, x, return_attention)
        x = x + self.drop_path(self.drop(y))
        y = self.mlp(self.norm2(x)) if path is None else path.mlp(self, x)
        x = x + self.drop_path(y)
        return x, probs


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass
class Intermediates:
    """What ``forward_intermediates`` returns, for analysis.

    ``hidden_states[i]`` is the input to block i (``hidden_states[0]`` is z_0, after the position
    embedding) and the last entry is the output of the final block before the final norm; ``attentions[i]``
    is block i's attention probabilities (B, h, T, T); ``features`` the final normed tokens; ``logits`` the
    head output.
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
    the position embedding is resampled on the fly (bilinear; sin-cos tables are recomputed).
    """

    pos_table: torch.Tensor  # fixed sin-cos table (buffer) when cfg.pos_embed == "sincos2d"

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.patch_embed: nn.Module = self._make_stem(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.classifier == "token" else None
        gh, gw = cfg.grid_size
        if cfg.pos_embed == "learned":
            self.pos_embed: nn.Parameter | None = nn.Parameter(torch.zeros(1, cfg.num_tokens(), D))
        else:
            self.pos_embed = None
            self.register_buffer("pos_table", torch.empty(1, gh * gw, D), persistent=False)
        self.pos_drop = nn.Dropout(cfg.dropout)
        rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList(Block(cfg, rate) for rate in rates)
        self.norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        rep = cfg.representation_size
        self.pre_logits: nn.Module = nn.Sequential(nn.Linear(D, rep), nn.Tanh()) if rep else nn.Identity()
        self.head: nn.Module = nn.Linear(rep or D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        if self.norm.weight.device.type != "meta":  # meta tensors hold no values to initialise, and PyTorch's
            self.init_weights()  # normal_ there goes through its compiler stack (a second of import per command)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Compute the fixed (non-learned) tensors: the sin-cos table when there is one."""
        if self.pos_embed is None:
            self.pos_table = sincos_2d(self.cfg.grid_size, self.cfg.hidden_size, device=self.pos_table.device)

    @staticmethod
    def _make_stem(cfg: ViTConfig) -> nn.Module:
        if cfg.resnet_layers is not None:  # hybrid (paper sec. 3.1): ResNet feature map -> patch conv
            return HybridEmbed(cfg.resnet_layers, cfg.resnet_width, cfg.patch_size, cfg.in_channels, cfg.hidden_size)
        return PatchEmbed(cfg.patch_size, cfg.in_channels, cfg.hidden_size)

    @property
    def num_features(self) -> int:
        """Width of the representation fed to the head (pre-logits size, or D)."""
        return self.cfg.representation_size or self.cfg.hidden_size

    # ---- initialisation --------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """The official initialisation (``vit_jax/models_vit.py`` with Flax defaults).

        - patch conv and pre-logits Dense: LeCun normal (truncated normal, variance 1/fan_in), zero bias;
        - q, k, v and output projections: Xavier uniform, each D x D kernel on its own, zero bias;
        - MLP kernels Xavier uniform, MLP biases normal(std=1e-6);
        - class token zeros, learned position embedding normal(std=0.02);
        - LayerNorm scale 1, bias 0; head kernel zeros, head bias ``head_bias_init``.
        """
        self.init_buffers()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        stem = self.patch_embed
        if isinstance(stem, PatchEmbed):
            lecun_normal_(stem.proj.weight)
            nn.init.zeros_(stem.proj.bias)  # type: ignore[arg-type]  # the patch conv always has a bias
        elif isinstance(stem, HybridEmbed):
            stem.init_weights()
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)
        for blk in self.blocks:
            assert isinstance(blk, Block)
            D = self.cfg.hidden_size
            for i in range(3):  # q, k, v: Xavier over (D, D) each, as three separate Flax kernels
                nn.init.xavier_uniform_(blk.attn.qkv.weight[i * D : (i + 1) * D])
            if blk.attn.qkv.bias is not None:
                nn.init.zeros_(blk.attn.qkv.bias)
            nn.init.xavier_uniform_(blk.attn.proj.weight)
            nn.init.zeros_(blk.attn.proj.bias)
            for fc in (blk.mlp.fc1, blk.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                nn.init.normal_(fc.bias, std=1e-6)
        if isinstance(self.pre_logits, nn.Sequential):
            dense = self.pre_logits[0]
            assert isinstance(dense, nn.Linear)
            lecun_normal_(dense.weight)
            nn.init.zeros_(dense.bias)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.constant_(self.head.bias, self.cfg.head_bias_init)

    # ---- eq. 1 -----------------------------------------------------------------------------------

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> z_0 (B, T, D): patch tokens, class token, position embedding, dropout."""
        grid = self.grid_of(x)
        x = self.patch_embed(x)  # (B, N, D)
        if self.pos_embed is None:  # fixed sin-cos on the patches; the class token gets none
            table = self.pos_table if grid == self.cfg.grid_size else sincos_2d(grid, x.shape[-1], device=x.device)
            x = x + table.to(x.dtype)
            if self.cls_token is not None:
                x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        else:
            if self.cls_token is not None:
                x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, T, D)
            pos: torch.Tensor = self.pos_embed
            if grid != self.cfg.grid_size:
                pos = resample_grid(pos, self.cfg.grid_size, grid, self.cfg.num_prefix_tokens)
            x = x + pos.to(x.dtype)
        return self.pos_drop(x)

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
        """Images (B, C, H, W) -> final normed tokens (B, T, D)."""
        x = self.embed(x)
        for blk in self.blocks:
            x, _ = blk(x)
        return self.norm(x)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D): the class token, or the mean of all tokens for GAP."""
        return tokens[:, 0] if self.cfg.classifier == "token" else tokens.mean(dim=1)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Final tokens (B, T, D) -> logits (B, K), or the representation (B, R) with ``pre_logits=True``."""
        x = self.pre_logits(self.pool(tokens))  # (B, R)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, attention: bool = True) -> Intermediates:
        """Run the model keeping every block's input/output and (optionally) attention probabilities."""
        z = self.embed(x)
        hidden, attns = [z], []
        for blk in self.blocks:
            z, probs = blk(z, return_attention=attention)
            hidden.append(z)
            if probs is not None:
                attns.append(probs)
        feats = self.norm(z)
        return Intermediates(hidden, attns, feats, self.forward_head(feats))

    # ---- resolution ------------------------------------------------------------------------------

    @torch.no_grad()
    def resize_image(self, image_size: int | tuple[int, int], method: str = "bilinear") -> None:
        """Change the model's native resolution in place, resampling the learned position-embedding grid.

        The patch size stays; the sequence grows or shrinks. ``method="bilinear"`` reproduces the official
        ``interpolate_posembed`` (scipy zoom, order 1); ``"bicubic"`` is timm's (antialiased; see ``resample_grid``).
        """
        new_cfg = _replace(self.cfg, image_size=image_size)  # checks that the stride divides the new size
        if self.pos_embed is not None:
            pe = resample_grid(
                self.pos_embed.data, self.cfg.grid_size, new_cfg.grid_size, self.cfg.num_prefix_tokens, method
            )
            self.pos_embed = nn.Parameter(pe)
        self.cfg = new_cfg
        self.init_buffers()

    @torch.no_grad()
    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """Replace the head by a zero-initialised one for ``num_classes`` (the paper's fine-tuning recipe).

        The pre-logits layer is dropped unless ``keep_pre_logits``.
        """
        rep = self.cfg.representation_size if keep_pre_logits else None
        if not keep_pre_logits:
            self.pre_logits = nn.Identity()
        width = rep or self.cfg.hidden_size
        ref = next(self.parameters())
        if num_classes > 0:
            head = nn.Linear(width, num_classes).to(ref.device, ref.dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
            self.head = head
        else:
            self.head = nn.Identity()
        self.cfg = _replace(self.cfg, num_classes=num_classes, representation_size=rep, head_bias_init=0.0)


def _replace(cfg: ViTConfig, **changes: Any) -> ViTConfig:
    d = cfg.to_dict()
    d.update(changes)
    return ViTConfig.from_dict(d)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable and frozen parameters (buffers such as sin-cos tables excluded)."""
    return sum(p.numel() for p in model.parameters())
