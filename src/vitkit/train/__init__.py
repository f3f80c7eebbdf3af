"""Training and fine-tuning: optimisers, EMA, resumable training state, the loop, multi-process wrapping.

The configuration it consumes (schema and recipes) lives one layer down, in :mod:`vitkit.configs`::

    from vitkit.configs import get_recipe
    from vitkit.train import train

    result = train(get_recipe("digits"), "runs/digits")
"""

from vitkit.train.trainer import NonFiniteLossError, Trainer, TrainResult, check_run_dir, train

__all__ = ["NonFiniteLossError", "TrainResult", "Trainer", "check_run_dir", "train"]
