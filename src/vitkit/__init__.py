"""vitkit: the Vision Transformer (Dosovitskiy et al., ICLR 2021) as practical software.

Public API::

    vitkit.create_model("B/16", num_classes=10)        # a freshly initialised ViT by paper name
    vitkit.load_pretrained("ViT-B_16.npz")             # any supported checkpoint, as a model
    vitkit.load_checkpoint(path)                       # model + metadata (preprocessing, class names)
    vitkit.save_pretrained(model, "out/", ...)         # vitkit's own format
    vitkit.optimize_for_inference(model)               # a fast bf16 (or int8) inference copy
"""

from vitkit.bench.fast import optimize_for_inference
from vitkit.checkpoints import load_checkpoint, load_pretrained
from vitkit.checkpoints.native import save as save_pretrained
from vitkit.data.preprocess import Preprocess
from vitkit.models import VisionTransformer, ViTConfig, create_model, list_models

__version__ = "0.1.0"

__all__ = [
    "Preprocess",
    "ViTConfig",
    "VisionTransformer",
    "__version__",
    "create_model",
    "list_models",
    "load_checkpoint",
    "load_pretrained",
    "optimize_for_inference",
    "save_pretrained",
]
