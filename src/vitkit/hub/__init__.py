"""Pretrained checkpoints by name: the registry of Google's ViTs, URLs, Hugging Face Hub ids, and a safe cache.

Sits below :mod:`vitkit.checkpoints` (imports only :mod:`vitkit.errors` and :mod:`vitkit.fileio`)::

    from vitkit.hub import resolve, download, cache_dir
    resolve("ViT-B_16-i21k-i1k-384").path        # registry name -> verified .npz in the cache
    resolve("google/vit-base-patch16-224").path  # Hugging Face Hub snapshot folder
    download("gs://vit_models/imagenet21k/ViT-B_16.npz")
"""

from vitkit.hub.cache import ENV_VAR, cache_dir
from vitkit.hub.download import DownloadError, Record, download, gs_to_https, is_cached, read_record, sha256_file
from vitkit.hub.labels import label_names, label_set_for
from vitkit.hub.registry import AmbiguousName, Entry, entries, lookup, search
from vitkit.hub.resolve import NotFound, Resolved, resolve

__all__ = [
    "ENV_VAR",
    "AmbiguousName",
    "DownloadError",
    "Entry",
    "NotFound",
    "Record",
    "Resolved",
    "cache_dir",
    "download",
    "entries",
    "gs_to_https",
    "is_cached",
    "label_names",
    "label_set_for",
    "lookup",
    "read_record",
    "resolve",
    "search",
    "sha256_file",
]
