"""Reading Google's flat ``.npz`` checkpoints and telling their layouts apart by structure alone.

Both Google code bases save a parameter tree flattened to "/"-joined keys, possibly under a prefix
(``opt/target/`` for old vit_jax training checkpoints, ``params/`` for big_vision, ``params/img/`` for the
image tower of a two-tower model). The layouts differ in module names:

- vit_jax (``official``): ``Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1``, ``MlpBlock_3``,
  ``LayerNorm_2``, position embedding at ``Transformer/posembed_input/pos_embedding``;
- big_vision: ``Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0``, ``MlpBlock_0``,
  ``LayerNorm_1`` (or the scan-stacked ``Transformer/encoderblock/...``), ``pos_embedding`` at the top.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from vitkit.checkpoints.keymap import Array
from vitkit.errors import CheckpointError
from vitkit.fileio import check_output_file, write_file_atomic

# what reading a corrupt .npz (a zip of .npy members) raises: zip structure, CRC, deflate, header errors
NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError, KeyError)
PREFIXES = ("", "opt/target/", "params/", "params/img/")


def find_prefix(keys: Iterable[str]) -> str | None:
    """The prefix under which the model's parameters live, judged by ``<prefix>embedding/kernel``."""
    ks = set(keys)
    for p in PREFIXES:
        if f"{p}embedding/kernel" in ks:
            return p
    return None


def layout(keys: Iterable[str]) -> str | None:
    """ "official", "big_vision", or None when the keys are neither (not a ViT checkpoint)."""
    ks = list(keys)
    p = find_prefix(ks)
    if p is None:
        return None
    inner = [k[len(p) :] for k in ks if k.startswith(p)]
    if any(k.startswith("Transformer/encoderblock/") for k in inner):
        return "big_vision"  # scan-stacked blocks exist only in big_vision
    if any(k.startswith("Transformer/encoderblock_0/MultiHeadDotProductAttention_1/") for k in inner):
        return "official"
    if any(k.startswith("Transformer/encoderblock_0/MultiHeadDotProductAttention_0/") for k in inner):
        return "big_vision"
    return None


def file_layout(path: Path) -> str | None:
    """The layout of an ``.npz`` file (reads only its index), or None."""
    if path.suffix != ".npz" or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return layout(z.files)
    except NPZ_ERRORS:
        return None


def read_npz(path: str | Path) -> dict[str, Array]:
    """All arrays of an .npz file, with a clear error for unreadable files."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except NPZ_ERRORS as e:
        raise CheckpointError(f"{path}: not a readable .npz checkpoint ({e})") from None


def strip_prefix(arrays: Mapping[str, Array], source: str) -> tuple[dict[str, Array], str, list[str]]:
    """(parameters without the prefix, the prefix, keys outside it such as optimizer state)."""
    p = find_prefix(arrays)
    if p is None:
        raise CheckpointError(f"{source}: no 'embedding/kernel' under any known prefix ({', '.join(PREFIXES[1:])})")
    inner = {k[len(p) :]: v for k, v in arrays.items() if k.startswith(p)}
    outside = sorted(k for k in arrays if not k.startswith(p))
    return inner, p, outside


def write_npz(arrays: Mapping[str, Array], path: str | Path, *, overwrite: bool = False) -> Path:
    """Write an .npz atomically; an existing file is replaced only with ``overwrite``."""
    out = Path(path)
    check_output_file(out, overwrite=overwrite)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]

    return write_file_atomic(out, write)
