"""Reading and writing PyTorch-side weight files safely: safetensors, or pickles through ``weights_only``.

``.pth``/``.pt``/``.bin`` files are read with ``torch.load(weights_only=True)`` only, so a checkpoint can never
run code. Folders are written atomically (a temporary folder swapped in by one rename).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vitkit import fileio, output_paths
from vitkit.errors import CheckpointError

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")


def read_state_file(path: Path) -> dict[str, torch.Tensor]:
    """A flat tensor dict from a .safetensors file or a weights-only pickle (unwrapping ``model``/``state_dict``)."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except (
        OSError, RuntimeError, pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError,
        AttributeError, OverflowError, UnicodeDecodeError, zipfile.BadZipFile,
    ) as e:  # a corrupt pickle or zip container: torch surfaces many kinds  # fmt: skip
        raise CheckpointError(f"{path}: not a readable weights-only PyTorch checkpoint ({_one_line(e)})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a state dict (a mapping of names to tensors)")
    return {str(k).removeprefix("module."): v for k, v in obj.items()}


def _one_line(e: BaseException) -> str:
    """torch.load's multi-paragraph refusals, reduced to their cause ("it stores numpy arrays ...")."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it needs {m.group(1)}, which a weights-only load refuses to import or run"
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    line = m.group(1) if m else next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return line if len(line) <= 200 else line[:197] + "..."


def read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``."""
    single = folder / "model.safetensors"
    if single.is_file():
        return read_state_file(single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{index}: invalid shard index ({e})") from None
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(read_state_file(_shard_path(folder, index, shard)))
        return out
    legacy = folder / "pytorch_model.bin"
    if legacy.is_file():
        return read_state_file(legacy)
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _shard_path(folder: Path, index: Path, name: object) -> Path:
    """The file a shard index names: a relative name inside ``folder`` (no absolute path, no ``..``, no folder
    on the way that leads out of it), and a regular file (not a FIFO or a device, which would block or never
    end); only the file itself may be a link, as huggingface_hub's cache stores it. CheckpointError otherwise."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(str(name)).is_absolute() or ".." in parts or "\\" in str(name):
        raise CheckpointError(f"{index}: shard {name!r} is not a file name inside {folder}; refused")
    path = folder.joinpath(*parts)
    try:
        inside = path.parent.resolve(strict=True).is_relative_to(folder.resolve(strict=True))
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the shard {name!r} ({e.strerror or e})") from None
    if not inside:
        raise CheckpointError(f"{index}: shard {name!r} lies outside {folder} (through a linked folder); refused")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: the shard {name!r} is not a regular file; refused")
    return path


def from_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A writer's arrays as contiguous tensors (sharing their memory where they are contiguous already)."""
    return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """float32 numpy copy of a tensor of any floating dtype (bfloat16 included)."""
    return t.detach().to(torch.float32).cpu().numpy() if t.is_floating_point() else t.cpu().numpy()


# what vitkit writes in a checkpoint folder, in any of its folder formats: vitkit (weights + config.json), hf
# (+ preprocessor_config.json), timm (weights + config.json)
FOLDER_FILES = ("model.safetensors", "config.json", "preprocessor_config.json")


def _folder_owned(folder: Path) -> bool:
    """vitkit wrote it: its weights carry vitkit's writer mark, or it is a vitkit-format folder (which older
    versions wrote without the mark)."""
    return fileio.safetensors_marked(folder / "model.safetensors") or folder_config(folder).get("format") == "vitkit"


def check_folder_output(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but a checkpoint folder vitkit wrote, whatever folder format it wrote there
    (vitkit, hf, timm: every writer of a folder checks this one rule), and that only with ``overwrite``."""
    output_paths.check_output_dir(
        out, allowed=FOLDER_FILES, owned=_folder_owned, overwrite=overwrite, what="checkpoint folder"
    )


def write_folder(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    files: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``model.safetensors`` plus text files into a folder, replacing an existing one atomically.

    An existing non-empty folder is replaced only when vitkit wrote it and ``overwrite`` is true.
    """
    out = Path(path)
    check_folder_output(out, overwrite)

    def write(tmp: Path) -> None:
        metadata = {"format": "pt", fileio.WRITER_KEY: fileio.WRITER}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata=metadata)
        for name, text in files.items():
            (tmp / name).write_text(text)

    return fileio.write_dir_atomic(out, write)


def folder_config(folder: Path, max_bytes: int | None = None) -> dict[str, Any]:
    """The JSON object in ``folder``'s config.json, as the format detectors look at it: empty when there is no
    such regular file, or it is unreadable, not a JSON object, or (``max_bytes``) larger than that."""
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        if max_bytes is None:
            doc = json.loads(path.read_text())
        else:
            with open(path, "rb") as f:
                text = f.read(max_bytes + 1)
            doc = json.loads(text) if len(text) <= max_bytes else None
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def readable_keys(path: Path) -> set[str]:
    """The tensor names of a state-dict file (safetensors: from its header; else :func:`read_state_file`), without
    building a model: what the format detectors look at; none when the file is unreadable (then it is not the
    format a detector asks about)."""
    try:
        return set(safetensors_shapes(path) if path.suffix == ".safetensors" else read_state_file(path))
    except CheckpointError:
        return set()


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """The tensor shapes in a .safetensors file's header (nothing else read: sizes before any allocation);
    CheckpointError naming the file when it is unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
