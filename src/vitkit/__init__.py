"""vitkit: the Vision Transformer (Dosovitskiy et al., ICLR 2021) as practical software.

Public API::

    vitkit.create_model("B/16", num_classes=10)        # a freshly initialised ViT by paper name
    vitkit.load_pretrained("ViT-B_16.npz")             # any supported checkpoint, as a model
    vitkit.load_checkpoint(path)                       # model + metadata (preprocessing, class names)
    vitkit.model_from("B/16" or path, **overrides)     # a variant name or any checkpoint, as a model
    vitkit.predict("ckpt/", ["a.jpg", "b.jpg"])        # top-5 labels per image with the checkpoint's preprocessing
    vitkit.embed("ckpt/", ["a.jpg", "b.jpg"])          # pre-logits features (or pooled/intermediate tokens)
    vitkit.save_pretrained(model, "out/", ...)         # vitkit's own format
    vitkit.optimize_for_inference(model)               # a fast bf16 (or int8) inference copy
    vitkit.open_dataset("digits", "train")             # digits, ImageFolder, CIFAR, .npz, WebDataset shards
    vitkit.train(vitkit.get_recipe("digits"), "runs/digits")   # a training run (resumable, 1..N processes)
    vitkit.evaluate_dataset(model, dataset, preprocess)  # top-1/top-5, per class, confusion matrix
    vitkit.fewshot_dataset(model, train, test, preprocess)  # the paper's few-shot linear probe

Analyses (the paper's figures 6, 7, 11) are in :mod:`vitkit.analysis`, benchmarks in :mod:`vitkit.bench`.
"""

from vitkit.checkpoints import load_checkpoint, load_pretrained, model_from
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.checkpoints.vitkit_format import save as save_pretrained
from vitkit.configs import TrainConfig, get_recipe
from vitkit.data.datasets import open_dataset
from vitkit.evaluate import evaluate_dataset, fewshot_dataset
from vitkit.inference import optimize_for_inference, predict
from vitkit.inference.embed import embed
from vitkit.models import VisionTransformer, ViTConfig, create_model, list_models
from vitkit.train import train
from vitkit.version import __version__

__all__ = [
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
