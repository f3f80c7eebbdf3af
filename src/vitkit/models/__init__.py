"""Pure nn.Modules: the ViT, its variants and position-embedding helpers. No training code here."""

from vitkit.models.variants import VARIANTS, create_model, list_models, model_config, parse_name
from vitkit.models.vit import Intermediates, VisionTransformer, ViTConfig, count_parameters

__all__ = [
    "VARIANTS",
    "Intermediates",
    "ViTConfig",
    "VisionTransformer",
    "count_parameters",
    "create_model",
    "list_models",
    "model_config",
    "parse_name",
]
