"""ViT variants by paper name (Table 1), the official hybrids, and ``create_model``.

A name is "<size>/<patch>", e.g. "B/16" or "L/14"; "ViT-B/16" and "B_16" are accepted too. Hybrids
(paper sec. 3.1, ``vit_jax/configs/models.py``) are named as officially: "R50+B/16", "R26+S/32",
"R26+B/32", "R50+L/32", "R+Ti/16" ("R50+ViT-B_16" and "R50_B_16" spellings too).
"""

from __future__ import annotations

import re
from typing import Any

from vitkit.errors import ConfigError
from vitkit.models.vit import VisionTransformer, ViTConfig

#: size -> (hidden_size D, depth L, heads, mlp_dim); paper Table 1 plus DeiT's Ti and S.
VARIANTS: dict[str, dict[str, int]] = {
    "Ti": {"hidden_size": 192, "depth": 12, "num_heads": 3, "mlp_dim": 768},
    "S": {"hidden_size": 384, "depth": 12, "num_heads": 6, "mlp_dim": 1536},
    "B": {"hidden_size": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072},
    "L": {"hidden_size": 1024, "depth": 24, "num_heads": 16, "mlp_dim": 4096},
    "H": {"hidden_size": 1280, "depth": 32, "num_heads": 16, "mlp_dim": 5120},
}
PATCH_SIZES = (8, 14, 16, 32)

# Official hybrids: name -> (transformer size, ResNet stage depths, patch size on the ResNet feature map).
# The "/16" or "/32" of the name is the nominal stride. R+Ti/16 is the root block alone (conv stride 2 and
# max-pool stride 2) with 8 x 8 patches, so the official definition actually has 32 pixels per token.
HYBRIDS: dict[str, tuple[str, tuple[int, ...], int]] = {
    "R+Ti/16": ("Ti", (), 8),
    "R26+S/32": ("S", (2, 2, 2, 2), 1),
    "R26+B/32": ("B", (2, 2, 2, 2), 1),
    "R50+B/16": ("B", (3, 4, 9), 1),
    "R50+L/32": ("L", (3, 4, 6, 3), 1),
}
_HYBRID = re.compile(r"^(?P<resnet>r\d*)[+_](?:vit[-_ ]?)?(?P<size>ti|s|b|l|h)[/_-]?(?P<patch>\d+)$", re.IGNORECASE)

_NAME = re.compile(r"^(?:vit[-_ ]?)?(?P<size>ti|s|b|l|h)[/_-]?(?P<patch>\d+)$", re.IGNORECASE)


def parse_name(name: str) -> tuple[str, int]:
    """ "ViT-B/16" -> ("B", 16). Raises ConfigError naming the valid choices."""
    m = _NAME.match(name.strip())
    if not m:
        raise ConfigError(f"unknown model {name!r}; expected a name like 'B/16' ({', '.join(list_models())})")
    size = {k.lower(): k for k in VARIANTS}[m.group("size").lower()]
    return size, int(m.group("patch"))


def list_models(hybrids: bool = False) -> list[str]:
    """All paper names: Ti, S, B, L, H with patch sizes 8, 14, 16 and 32 (and the official hybrids)."""
    return [f"{s}/{p}" for s in VARIANTS for p in PATCH_SIZES] + (list(HYBRIDS) if hybrids else [])


def hybrid_name(name: str) -> str | None:
    """ "R50+ViT-B_16" -> "R50+B/16"; None for a name that is not a hybrid's."""
    m = _HYBRID.match(name.strip())
    if not m:
        return None
    canonical = f"{m.group('resnet')}+{m.group('size')}/{m.group('patch')}"
    for known in HYBRIDS:
        if known.lower() == canonical.lower():
            return known
    raise ConfigError(f"unknown hybrid {name!r}; the official hybrids are {', '.join(HYBRIDS)}")


def model_config(name: str, **overrides: Any) -> ViTConfig:
    """The ViTConfig of a named variant (224 px, 1000 classes) with any field overridden."""
    hybrid = hybrid_name(name)
    kwargs: dict[str, Any]
    if hybrid is not None:
        size, layers, patch = HYBRIDS[hybrid]
        kwargs = {"name": hybrid, "patch_size": patch, "resnet_layers": layers, **VARIANTS[size]}
    else:
        size, patch = parse_name(name)
        kwargs = {"name": f"{size}/{patch}", "patch_size": patch, **VARIANTS[size]}
    kwargs.update(overrides)
    try:
        return ViTConfig(**kwargs)
    except (TypeError, ValueError) as e:
        if hybrid is None and kwargs["patch_size"] not in PATCH_SIZES and "image_size" not in overrides:
            raise ConfigError(
                f"unknown variant {name!r}: the variants are {', '.join(VARIANTS)} with patch size "
                f"{', '.join(map(str, PATCH_SIZES))} (e.g. B/16); another patch size needs an image size it divides"
            ) from None
        raise ConfigError(f"model {name}: {e}") from None


def create_model(name: str | ViTConfig, **overrides: Any) -> VisionTransformer:
    """Build a freshly initialised ViT from a paper name ("B/16") or a ViTConfig, with overrides.

    >>> m = create_model("Ti/16", num_classes=10, image_size=32)
    """
    if isinstance(name, ViTConfig):
        try:
            cfg = name.replace(**overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    else:
        cfg = model_config(name, **overrides)
    return VisionTransformer(cfg)
