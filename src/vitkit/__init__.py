"""vitkit: the Vision Transformer (Dosovitskiy et al., ICLR 2021) as practical software.

Public API::

    vitkit.create_model("B/16", num_classes=10)        # a freshly initialised ViT by paper name
    vitkit.load_pretrained("ViT-B_16.npz")             # any supported checkpoint, as a model
    vitkit.load_checkpoint(path)                       # model + metadata (preprocessing, class names)
    vitkit.model_from("B/16" or path, **overrides)     # a variant name or any checkpoint, as a model
    vitkit.predict("ckpt/", ["a.jpg", "b.jpg"])        # top-5 labels per image with the checkpoint's preprocessing
    vitkit.embed("ckpt/", ["a.jpg", "b.jpg"])          # pre-logits features (or pooled/intermediate tokens)
    vitkit.Index.open("photos.index").search(q, 10)    # similarity search over embeddings (exact or HNSW)
    vitkit.save_pretrained(model, "out/", ...)         # vitkit's own format
    vitkit.optimize_for_inference(model)               # a fast bf16 (or int8) inference copy
    vitkit.open_dataset("digits", "train")             # digits, ImageFolder, CIFAR, .npz, WebDataset shards
    vitkit.train(vitkit.get_recipe("digits"), "runs/digits")   # a training run (resumable, 1..N processes)
    vitkit.evaluate_dataset(model, dataset, preprocess)  # top-1/top-5, per class, confusion matrix
    vitkit.fewshot_dataset(model, train, test, preprocess)  # the paper's few-shot linear probe

Analyses (the paper's figures 6, 7, 11) are in :mod:`vitkit.analysis`, benchmarks in :mod:`vitkit.bench`.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vitkit.lazy import lazy_attributes
from vitkit.version import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers; imported on first use (``__getattr__``)
    from vitkit.checkpoints import load_checkpoint, load_pretrained, model_from
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.checkpoints.vitkit_format import save as save_pretrained
    from vitkit.configs import TrainConfig, get_recipe
    from vitkit.data.datasets import open_dataset
    from vitkit.evaluate import evaluate_dataset, fewshot_dataset
    from vitkit.inference import optimize_for_inference
    from vitkit.inference.embed import embed
    from vitkit.inference.predict import predict
    from vitkit.models import VisionTransformer, ViTConfig, create_model, list_models
    from vitkit.search import Index
    from vitkit.train import train

# public name -> (module, attribute): ``import vitkit`` (and so every ``vitkit`` command, whose modules live
# under this package) imports none of the library until a name is used -- a command loads what it runs
_LAZY: dict[str, tuple[str, str]] = {
    "load_checkpoint": ("vitkit.checkpoints", "load_checkpoint"),
    "load_pretrained": ("vitkit.checkpoints", "load_pretrained"),
    "model_from": ("vitkit.checkpoints", "model_from"),
    "Preprocess": ("vitkit.checkpoints.preprocess", "Preprocess"),
    "save_pretrained": ("vitkit.checkpoints.vitkit_format", "save"),
    "TrainConfig": ("vitkit.configs", "TrainConfig"),
    "get_recipe": ("vitkit.configs", "get_recipe"),
    "open_dataset": ("vitkit.data.datasets", "open_dataset"),
    "evaluate_dataset": ("vitkit.evaluate", "evaluate_dataset"),
    "fewshot_dataset": ("vitkit.evaluate", "fewshot_dataset"),
    "optimize_for_inference": ("vitkit.inference", "optimize_for_inference"),
    "predict": ("vitkit.inference", "predict"),
    "embed": ("vitkit.inference.embed", "embed"),
    "Index": ("vitkit.search", "Index"),
    "VisionTransformer": ("vitkit.models", "VisionTransformer"),
    "ViTConfig": ("vitkit.models", "ViTConfig"),
    "create_model": ("vitkit.models", "create_model"),
    "list_models": ("vitkit.models", "list_models"),
    "train": ("vitkit.train", "train"),
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(ModuleType):
    """The ``vitkit`` module, whose ``train`` stays the function when the subpackage ``vitkit.train`` is
    imported (the import system sets a package's attribute to each submodule it loads; an eager
    ``from vitkit.train import train`` used to rebind it last)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "train" and isinstance(value, ModuleType):
            value = value.train
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "Index",
    "Preprocess",
    "TrainConfig",
    "ViTConfig",
    "VisionTransformer",
    "__version__",
    "create_model",
    "embed",
    "evaluate_dataset",
    "fewshot_dataset",
    "get_recipe",
    "list_models",
    "load_checkpoint",
    "load_pretrained",
    "model_from",
    "open_dataset",
    "optimize_for_inference",
    "predict",
    "save_pretrained",
    "train",
]
