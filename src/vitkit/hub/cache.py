"""Where vitkit keeps what it downloads: one cache directory.

Chosen in this order: an explicit ``cache_dir`` (``--cache-dir``), the ``VITKIT_HOME`` environment variable
(like ``TORCH_HOME`` / ``HF_HOME``), ``$XDG_CACHE_HOME/vitkit``, then the platform's user cache directory
(``~/.cache/vitkit`` on Linux, ``~/Library/Caches/vitkit`` on macOS, ``%LOCALAPPDATA%\\vitkit\\Cache`` on
Windows). Hugging Face Hub repositories stay in huggingface_hub's own cache (``HF_HOME``/``HF_HUB_CACHE``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The environment variable that names vitkit's cache folder (downloads, compiled kernels).
ENV_VAR = "VITKIT_HOME"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory (not created here)."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vitkit"
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "vitkit"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return (Path(local) if local else home / "AppData" / "Local") / "vitkit" / "Cache"
    return home / ".cache" / "vitkit"
