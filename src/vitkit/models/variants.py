"""ViT variants by paper name (Table 1), and ``create_model``.

A name is "<size>/<patch>", e.g. "B/16" or "L/14"; "ViT-B/16" and "B_16" are accepted too.
"""

from __future__ import annotations

import re
from typing import Any

from vitkit.errors import ConfigError
from vitkit.models.vit import VisionTransformer, ViTConfig

# size -> (hidden_size D, depth L, heads, mlp_dim); paper Table 1 plus DeiT's Ti and S.
VARIANTS: dict[str, dict[str, int]] = {
    "Ti": {"hidden_size": 192, "depth": 12, "num_heads": 3, "mlp_dim": 768},
    "S": {"hidden_size": 384, "depth": 12, "num_heads": 6, "mlp_dim": 1536},
    "B": {"hidden_size": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072},
    "L": {"hidden_size": 1024, "depth": 24, "num_heads": 16, "mlp_dim": 4096},
    "H": {"hidden_size": 1280, "depth": 32, "num_heads": 16, "mlp_dim": 5120},
}
PATCH_SIZES = (8, 14, 16, 32)

_NAME = re.compile(r"^(?:vit[-_ ]?)?(?P<size>ti|s|b|l|h)[/_-]?(?P<patch>\d+)$", re.IGNORECASE)


def parse_name(name: str) -> tuple[str, int]:
    """ "ViT-B/16" -> ("B", 16). Raises ConfigError naming the valid choices."""
    m = _NAME.match(name.strip())
    if not m:
        raise ConfigError(f"unknown model {name!r}; expected a name like 'B/16' ({', '.join(list_models())})")
    size = {k.lower(): k for k in VARIANTS}[m.group("size").lower()]
    return size, int(m.group("patch"))


def list_models() -> list[str]:
    """All paper names: Ti, S, B, L, H with patch sizes 8, 14, 16 and 32."""
    return [f"{s}/{p}" for s in VARIANTS for p in PATCH_SIZES]


def model_config(name: str, **overrides: Any) -> ViTConfig:
    """The ViTConfig of a named variant (224 px, 1000 classes) with any field overridden."""
    size, patch = parse_name(name)
    kwargs: dict[str, Any] = {"name": f"{size}/{patch}", "patch_size": patch, **VARIANTS[size]}
    kwargs.update(overrides)
    try:
        return ViTConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model {name}: {e}") from None


def create_model(name: str | ViTConfig, **overrides: Any) -> VisionTransformer:
    """Build a freshly initialised ViT from a paper name ("B/16") or a ViTConfig, with overrides.

    >>> m = create_model("Ti/16", num_classes=10, image_size=32)
    """
    if isinstance(name, ViTConfig):
        d = name.to_dict()
        d.update(overrides)
        try:
            cfg = ViTConfig.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    else:
        cfg = model_config(name, **overrides)
    return VisionTransformer(cfg)
