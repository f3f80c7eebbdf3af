"""Training configuration: the typed schema (``schema``), the recipes that fill it in (``recipes``) and typed
changes to them (``overrides``: the command line's options and ``--set KEY=VALUE``).

Both sit below ``vitkit.train``: a config is data, the trainer consumes it.
"""

from vitkit.configs.overrides import apply_overrides, finetune_config, parse_sets
from vitkit.configs.recipes import FINETUNE_STEPS, RECIPES, get_recipe
from vitkit.configs.schema import AdaptConfig, AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig

__all__ = [
    "FINETUNE_STEPS",
    "RECIPES",
    "AdaptConfig",
    "AugConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_overrides",
    "finetune_config",
    "get_recipe",
    "parse_sets",
]
