"""Training configuration: the typed schema (``schema``) and the recipes that fill it in (``recipes``).

Both sit below ``vitkit.train``: a config is data, the trainer consumes it.
"""

from vitkit.configs.recipes import FINETUNE_STEPS, RECIPES, get_recipe
from vitkit.configs.schema import AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig

__all__ = [
    "FINETUNE_STEPS",
    "RECIPES",
    "AugConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "get_recipe",
]
