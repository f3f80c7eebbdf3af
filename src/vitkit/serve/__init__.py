"""Serving a ViT: an HTTP inference server with dynamic batching (``vitkit serve``) and a web demo
(``vitkit demo``). Needs the ``serve`` extra: ``pip install 'vitkit[serve]'``.

The model side (:mod:`vitkit.serve.served_model`, :mod:`vitkit.serve.batcher`) needs only torch and Pillow; the
web stacks (FastAPI/uvicorn, Gradio) are imported by :mod:`vitkit.serve.app` and :mod:`vitkit.serve.demo`.
"""

from vitkit.serve.batcher import Batcher, QueueFull
from vitkit.serve.served_model import RequestError, ServedModel, resolve_precision

__all__ = ["Batcher", "QueueFull", "RequestError", "ServedModel", "resolve_precision"]
