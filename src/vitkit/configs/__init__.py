"""Training configuration: the typed schema (``schema``), the recipes that fill it in (``recipes``) and typed
changes to them (``overrides``: the command line's options and ``--set KEY=VALUE``).

Both sit below ``vitkit.train``: a config is data, the trainer consumes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitkit.configs.schema import AdaptConfig, AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig
from vitkit.lazy import lazy_attributes

if TYPE_CHECKING:
    from vitkit.configs.overrides import apply_overrides, finetune_config, parse_sets
    from vitkit.configs.recipes import FINETUNE_STEPS, RECIPES, get_recipe

# imported on first use (PEP 562): the recipes and overrides import the model code (torch), which the command
# line's parser, building ``train``'s flags from the recipe names, does not need
_LAZY = {
    "apply_overrides": "vitkit.configs.overrides",
    "finetune_config": "vitkit.configs.overrides",
    "parse_sets": "vitkit.configs.overrides",
    "FINETUNE_STEPS": "vitkit.configs.recipes",
    "RECIPES": "vitkit.configs.recipes",
    "get_recipe": "vitkit.configs.recipes",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


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
