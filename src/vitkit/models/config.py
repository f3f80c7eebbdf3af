"""The one description of a ViT's architecture: :class:`ViTConfig`.

The paper's ViT is the default. The options after it describe the descendants that load into the same model
(DeiT, CLIP, SigLIP, DINOv2, DINOv3): each is read by the plain model (``vitkit.models.vit``) and by the
inference fast path (``vitkit.inference.fast``), which are both built from this description; neither has a
forward of its own for a family. Token order is ``[class, distillation, registers..., patches]``.

| option | paper | what it changes |
|---|---|---|
| ``classifier`` | "token" | pooling: class token, "gap" (mean of the patch tokens), "map" (attention pooling) |
| ``class_token`` | derived | a class token even when pooling is not "token" (None: iff ``classifier == "token"``) |
| ``distilled`` | False | DeiT's distillation token after the class token, and a second head averaged with the first |
| ``num_registers`` | 0 | extra learned tokens (DINOv2/v3 "registers") after the class token, without position |
| ``pos_embed`` | "learned" | "sincos2d" (fixed table on the patches), "none" (RoPE models) |
| ``pos_embed_prefix`` | True | the learned position embedding has slots for the class/distillation tokens |
| ``pos_resample`` | "bilinear" | how a learned grid is resampled for other image sizes (``posembed.resample_grid``) |
| ``rope`` / ``rope_theta`` | None | rotary position embedding of q and k on the patch tokens ("dinov3"; "eva") |
| ``rope_ref_grid`` | None | "eva": the grid its coordinates are scaled to (EVA-02's ``ref_feat_shape``; None: none) |
| ``layer_scale`` | None | per-channel scales on both residual branches, initialised to this value |
| ``attn_norm`` | False | a LayerNorm on the attention's merged heads before its output projection (EVA-CLIP's) |
| ``mlp_norm`` | False | a LayerNorm on the MLP's hidden activation before its second Dense (EVA-02's sub-LN) |
| ``fc_norm`` | False | the final LayerNorm on the pooled vector ("gap") instead of on the tokens (timm's fc_norm) |
| ``mlp`` | "plain" | "swiglu": silu(x W_gate) * (x W_up) W_down (``mlp_dim`` is the gated width) |
| ``gelu`` | "exact" | the activation: "tanh" (GELU's tanh form), "quick" (x sigmoid(1.702 x), OpenAI CLIP) |
| ``norm_pre`` | False | a LayerNorm on the tokens before the first block (CLIP's ``ln_pre``) |
| ``patch_bias`` | True | the patch projection's bias (CLIP has none) |
| ``key_bias`` | True | the key projection's bias (DINOv3 has none; with RoPE a key bias is not softmax-invariant) |
| ``projection_size`` | None | a bias-free projection of the pooled token (CLIP's image embedding) |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from vitkit.models.config_checks import check_config, is_int
from vitkit.models.resnet import resnet_reduction

Classifier = Literal["token", "gap", "map"]
PosEmbed = Literal["learned", "sincos2d", "none"]
Gelu = Literal["exact", "tanh", "quick"]
MlpKind = Literal["plain", "swiglu"]
Rope = Literal["dinov3", "eva"]
Resample = Literal["bilinear", "bicubic", "bicubic_plain", "bicubic_offset"]


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT's architecture (not how it is trained); the options are in the module
    docstring's table.

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
    classifier: Classifier = "token"  # "token": class token; "gap": mean of the final normed patch tokens
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
    # the descendants' options (module docstring); the defaults are the paper's ViT
    class_token: bool | None = None  # None: a class token iff classifier == "token"
    distilled: bool = False
    num_registers: int = 0
    pos_embed_prefix: bool = True
    pos_resample: Resample = "bilinear"
    rope: Rope | None = None
    rope_theta: float = 100.0
    rope_ref_grid: tuple[int, int] | None = None
    layer_scale: float | None = None
    mlp: MlpKind = "plain"
    attn_norm: bool = False
    mlp_norm: bool = False
    fc_norm: bool = False
    norm_pre: bool = False
    patch_bias: bool = True
    key_bias: bool = True
    projection_size: int | None = None
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
        ref = self.rope_ref_grid
        if ref is not None:
            if not (isinstance(ref, (tuple, list)) and len(ref) == 2 and all(is_int(n) and n > 0 for n in ref)):
                raise ValueError(f"invalid ViT config: rope_ref_grid must be None or two positive ints, got {ref!r}")
            object.__setattr__(self, "rope_ref_grid", (int(ref[0]), int(ref[1])))
        if self.class_token is None:
            object.__setattr__(self, "class_token", self.classifier == "token")
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
        """Sequence length T: the patches of the grid plus the prefix tokens (default: the configured size)."""
        gh, gw = self.grid_at(self.image_size if image_size is None else image_size)
        return gh * gw + self.num_prefix_tokens

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: class, distillation and register tokens."""
        return int(bool(self.class_token)) + int(self.distilled) + self.num_registers

    @property
    def num_pos_prefix(self) -> int:
        """Prefix tokens that have a slot in the learned position embedding (class and distillation tokens,
        never registers; none for the fixed table)."""
        if self.pos_embed != "learned" or not self.pos_embed_prefix:
            return 0
        return int(bool(self.class_token)) + int(self.distilled)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("image_size", "resnet_layers", "rope_ref_grid"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ViT config keys: {', '.join(unknown)}")
        d = dict(d)
        for key in ("image_size", "resnet_layers", "rope_ref_grid"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)

    def replace(self, **changes: Any) -> ViTConfig:
        """A copy with fields changed, checked as every new config is (``from_dict``: unknown names refused)."""
        return ViTConfig.from_dict({**self.to_dict(), **changes})
