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

import math
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.keymap import Array
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta
from vitkit.checkpoints.preprocess import INCEPTION_MEAN, INCEPTION_STD, Preprocess
from vitkit.errors import CheckpointError, VitkitError
from vitkit.fileio import write_file_atomic
from vitkit.models.vit import ViTConfig
from vitkit.output_paths import check_output_file

# what reading a corrupt .npz (a zip of .npy members) raises: zip structure, CRC, deflate, header errors, and an
# array too large for memory (MemoryError: never a traceback, though check_npz_members refuses a lying header first)
NPZ_ERRORS = (
    OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError, KeyError, MemoryError,
)  # fmt: skip
# deflate expands at most about 1032:1; a member whose size in the zip's directory says more is refused
MAX_DEFLATE_RATIO = 1032
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


def file_keys(path: Path) -> list[str] | None:
    """The array names of an ``.npz`` file (reads only its index), or None when it is no readable ``.npz``."""
    if path.suffix != ".npz" or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return list(z.files)
    except NPZ_ERRORS:
        return None


def file_layout(path: Path) -> str | None:
    """The layout of an ``.npz`` file (reads only its index), or None."""
    keys = file_keys(path)
    return None if keys is None else layout(keys)


def check_npz_members(path: str | Path, error: type[VitkitError]) -> None:
    """``error`` naming the file and member when an ``.npz`` member's ``.npy`` header declares more bytes than the
    member holds, or the member more than its compressed bytes can expand to (stored: as many; deflated: at most
    :data:`MAX_DEFLATE_RATIO` times) or than the file holds: numpy allocates what a header declares before reading
    (a 522-byte file declaring 4 TiB). Reads the zip's directory and each member's header only."""
    size = Path(path).stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                problem = _member_problem(zf, info, size)
                if problem is not None:
                    raise error(f"{path}: member {info.filename!r}: {problem}")
    except NPZ_ERRORS as e:
        raise error(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None


def _member_problem(zf: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> str | None:
    if info.header_offset + info.compress_size > size:
        return f"{info.compress_size} compressed bytes at byte {info.header_offset} of a {size}-byte file"
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return "compressed with other than deflate (numpy writes stored or deflated members)"
    ratio = 1 if info.compress_type == zipfile.ZIP_STORED else MAX_DEFLATE_RATIO
    if info.file_size > info.compress_size * ratio + 1024:
        return f"{info.file_size} bytes from {info.compress_size} compressed (more than deflate can expand to)"
    if not info.filename.endswith(".npy"):
        return None
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        if dtype.hasobject:  # numpy's allow_pickle=False refuses it, naming why
            return None
        declared, held = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
        if declared > held:
            return f"its header declares {shape} {dtype} ({declared} bytes) in {held} bytes of data"
    return None


def read_npz(path: str | Path) -> dict[str, Array]:
    """All arrays of an .npz file, with a clear error for unreadable files; each member's size checked from its
    header first (:func:`check_npz_members`)."""
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: no such file")
    check_npz_members(path, CheckpointError)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except NPZ_ERRORS as e:
        raise CheckpointError(f"{path}: not a readable .npz checkpoint ({e})") from None


def checkpoint(
    format: str, path: Path, cfg: ViTConfig, state: dict[str, torch.Tensor], provenance: dict[str, Any]
) -> Checkpoint:
    """A checkpoint read from one of Google's ``.npz`` formats, which hold no metadata: the preprocessing is Google's
    code's (squash to the model's size, inputs scaled to [-1, 1])."""
    preprocess = Preprocess(image_size=cfg.image_size, mean=INCEPTION_MEAN, std=INCEPTION_STD)
    return Checkpoint(cfg, state, CheckpointMeta(format, str(path), preprocess, provenance=provenance))


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
