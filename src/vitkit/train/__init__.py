"""Training and fine-tuning: configs, optimisers, EMA, checkpoints, the loop, multi-process wrapping.

from vitkit.train import train
from vitkit.configs import get_recipe

result = train(get_recipe("digits"), "runs/digits")
"""

from vitkit.train.config import AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig
from vitkit.train.trainer import NonFiniteLossError, Trainer, TrainResult, train

__all__ = [
    "AugConfig",
    "DataConfig",
    "ModelConfig",
    "NonFiniteLossError",
    "OptimConfig",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "train",
]
