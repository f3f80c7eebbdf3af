"""Checkpoint formats: one declarative, shape-checked key map per foreign layout.

``load_checkpoint(name)`` takes a local path, a URL, a registry name (``vitkit models``) or a Hugging Face Hub
id (resolved by :mod:`vitkit.hub`), detects the format from the file's structure (or takes ``format=``),
converts it to vitkit's layout, builds the model and returns it with its metadata (preprocessing, class names).
``save_checkpoint(model, path, format)`` writes any format that can represent the model exactly.

==========  ==========================================================================================
name        what
==========  ==========================================================================================
vitkit      folder: model.safetensors + config.json (config, preprocessing, class names, provenance)
official    Google ViT/AugReg/hybrid .npz, vit_jax names
big_vision  big_vision .npz (params/ prefix, Linen names, scan-stacked or not)
hf          Hugging Face transformers ViT folder (config.json + model.safetensors)
timm        timm ViT state dict (.safetensors/.pth) or timm hub folder
siglip      big_vision SigLIP .npz image tower (params/img/, MAP head)
openclip    OpenAI CLIP / OpenCLIP state dict (visual.*), read only
dinov2      official DINOv2 state dict (facebookresearch/dinov2 hub .pth), read only
lora        LoRA adapters + head, loaded onto (and merged into) the base checkpoint they name
==========  ==========================================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from vitkit.checkpoints import (
    big_vision,
    dinov2_official,
    hf_folder,
    lora_format,
    npz_files,
    official,
    openclip,
    siglip_npz,
    timm_eva,
    timm_eva02,
    timm_format,
    timm_writer,
    torch_files,
    vitkit_format,
)
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    Loaded,
    check_preprocess,
    empty_model,
    expected_state,
)
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import CheckpointError, ConfigError
from vitkit.fileio import complete_dir
from vitkit.hub import Resolved, label_names, label_set_for, resolve
from vitkit.hub.resolve import NotFound, looks_like_variant
from vitkit.models.variants import PATCH_SIZES, create_model, parse_name
from vitkit.models.vit import VisionTransformer
from vitkit.output_paths import check_not_input, check_output_file


class SaveFn(Protocol):
    def __call__(
        self, model: VisionTransformer, path: Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
    ) -> Path: ...


@dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it, read it into vitkit's layout, and write it."""

    name: str
    description: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], Checkpoint]
    save: SaveFn | None = None
    # may ``save`` write this path (``overwrite`` as given)? Raises the error ``save`` would raise, without the
    # model: commands ask it before loading anything
    check_output: Callable[[Path, bool], None] | None = None


def _save_vitkit(
    model: VisionTransformer, path: Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    if meta is None:
        return vitkit_format.save(model, path, overwrite=overwrite)
    names = meta.class_names if meta.class_names and len(meta.class_names) == model.cfg.num_classes else None
    provenance = {**meta.provenance, "converted_from": meta.format, "source": meta.source}
    return vitkit_format.save(
        model, path, preprocess=meta.preprocess, class_names=names, provenance=provenance, overwrite=overwrite
    )


def _load_lora(path: Path, lora_base: str | os.PathLike[str] | None = None) -> Checkpoint:
    """An adapter folder merged onto its base checkpoint (``lora_base``, else the one its config names), which
    this package's loader reads (any format)."""
    return lora_format.load(path, lora_base, load_base=load_checkpoint)


def _is_run(path: Path) -> bool:
    if not path.is_dir() or vitkit_format.looks_like(path) or lora_format.looks_like(path):
        return False
    model = complete_dir(path / "model")
    return vitkit_format.looks_like(model) or lora_format.looks_like(model)  # LoRA runs with --save-adapters


def _load_run(path: Path, lora_base: str | os.PathLike[str] | None = None) -> Checkpoint:
    """The run's ``model/``; while training replaces it (two renames), the previous one is read instead."""
    tried = None
    while True:
        folder = complete_dir(path / "model")
        try:
            return _load_lora(folder, lora_base) if lora_format.looks_like(folder) else vitkit_format.load(folder)
        except CheckpointError:
            if folder == tried:
                raise
            tried = folder  # a replace may have moved it between the lookup and the read: look once more


def _check_file_output(out: Path, overwrite: bool) -> None:
    check_output_file(out, overwrite=overwrite)


#: The formats by name: how each is detected, read and (where it can be) written.
FORMATS: dict[str, Format] = {
    "vitkit": Format(
        "vitkit",
        "vitkit folder: model.safetensors + config.json",
        vitkit_format.looks_like,
        vitkit_format.load,
        _save_vitkit,
        torch_files.check_folder_output,
    ),
    "lora": Format(
        "lora",
        "LoRA adapters + head beside their base checkpoint (vitkit finetune --method lora --save-adapters)",
        lora_format.looks_like,
        _load_lora,
    ),
    "run": Format("run", "vitkit training run folder (its model/ subfolder)", _is_run, _load_run),
    "official": Format(
        "official",
        "Google ViT/AugReg/hybrid .npz (vit_jax layout, pre-Linen names)",
        lambda p: npz_files.file_layout(p) == "official",
        official.load,
        official.save,
        _check_file_output,
    ),
    "big_vision": Format(
        "big_vision",
        "big_vision .npz (params/ prefix, Linen names, per-block or scan-stacked)",
        lambda p: big_vision.looks_like(p) and not siglip_npz.looks_like(p),
        big_vision.load,
        big_vision.save,
        _check_file_output,
    ),
    "hf": Format(
        "hf",
        "Hugging Face transformers folder (ViT, DINOv2, DeiT, CLIP, SigLIP)",
        hf_folder.looks_like,
        hf_folder.load,
        hf_folder.save,
        torch_files.check_folder_output,
    ),
    "timm": Format(
        "timm",
        "timm ViT state dict (.safetensors/.pth file, or timm hub folder; DINOv3 written as timm's Eva)",
        lambda p: timm_format.looks_like(p) and not dinov2_official.looks_like(p) and not timm_eva.looks_like(p),
        timm_format.load,
        lambda model, path, meta=None, *, overwrite=False: (timm_eva02.save if model.cfg.rope else timm_writer.save)(
            model, path, meta, overwrite=overwrite
        ),
        timm_writer.check_output,
    ),
    "timm_eva": Format(
        "timm_eva",
        "timm Eva state dict of DINOv3 or EVA-02 (timm's eva.py: vit_*_patch16_dinov3, eva02_*; with its config.json)",
        timm_eva.looks_like,
        timm_eva02.load,
        timm_eva02.save,
        timm_writer.check_output,
    ),
    "siglip": Format(
        "siglip",
        "big_vision SigLIP .npz image tower (params/img/, MAPHead_0)",
        siglip_npz.looks_like,
        siglip_npz.load,
        siglip_npz.save,
        _check_file_output,
    ),
    "openclip": Format(
        "openclip",
        "OpenAI CLIP / OpenCLIP state dict, its image tower (visual.*), read only",
        openclip.looks_like,
        openclip.load,
    ),
    "dinov2": Format(
        "dinov2",
        "official DINOv2 state dict (facebookresearch/dinov2 hub .pth: mask_token, register_tokens, mlp.w12/w3)",
        dinov2_official.looks_like,
        dinov2_official.load,
    ),
}


def is_variant_name(name: str | os.PathLike[str]) -> bool:
    """True when ``name`` names a model variant (``B/16``, ``R50+B/16``) rather than a checkpoint: it is no
    local path and is spelled like a variant (size letters / patch digits). Everything else (paths, URLs,
    registry names, hub ids) is a checkpoint."""
    return looks_like_variant(os.fspath(name))


def detect_format(path: str | os.PathLike[str]) -> str:
    """Name of the format of the checkpoint at ``path``, judged from its structure (never from its name)."""
    p = complete_dir(Path(path))
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    found = [fmt.name for fmt in FORMATS.values() if fmt.detect(p)]
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(f"{p}: ambiguous layout, matches {', '.join(found)}; name one with --format / format=")
    raise CheckpointError(
        f"{p}: not a checkpoint in any known format ({', '.join(FORMATS)}); "
        "name the format (--format / format=) to force one"
    )


def read_checkpoint(
    path: str | os.PathLike[str],
    format: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    lora_base: str | os.PathLike[str] | None = None,
) -> Checkpoint:
    """The checkpoint converted to vitkit's state-dict layout, not yet placed in a model.

    ``path``: a local file or folder (always wins), an ``http(s)://`` / ``gs://`` URL, a registry name or a
    Hugging Face Hub id ``org/name[@revision]``; remote ones are downloaded once into the cache
    (``cache_dir``, default :func:`vitkit.hub.cache_dir`). ``lora_base``: for a LoRA adapter folder (or a run
    that saved one), the base checkpoint to merge onto instead of the one its config.json names; a remote base
    that only the folder names is never fetched (see :func:`vitkit.checkpoints.lora_format.check_declared_base`).
    """
    local = complete_dir(Path(path))
    found = _resolve(local if local.exists() else path, cache_dir)
    name = format or (found.entry.format if found.entry else None) or detect_format(found.path)
    if name not in FORMATS:
        raise ConfigError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")
    if lora_base is not None:
        if name not in ("lora", "run"):
            raise ConfigError(f"{path}: lora_base is for a LoRA adapter folder, and this is a {name} checkpoint")
        ckpt = (_load_lora if name == "lora" else _load_run)(found.path, lora_base)
    elif found.family is not None and found.family.load_options and name == "timm":
        ckpt = timm_format.load(found.path, **found.family.load_options)  # what timm's hub config leaves out
    else:
        ckpt = FORMATS[name].load(found.path)
    check_preprocess(ckpt.cfg, ckpt.meta.preprocess, ckpt.meta.source)  # every format (the readers name the file)
    return replace(ckpt, meta=_with_source_metadata(ckpt.meta, ckpt.cfg.num_classes, found))


def _resolve(name: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None) -> Resolved:
    """:func:`vitkit.hub.resolve`; a name found nowhere that spells a variant another way (``vit-b16``) is told
    the variant's name."""
    try:
        return resolve(name, cache_dir=cache_dir)
    except NotFound as e:
        try:
            size, patch = parse_name(os.fspath(name))
        except ConfigError:
            raise e from None
        if patch not in PATCH_SIZES or looks_like_variant(os.fspath(name)):
            raise
        variant = f"{size}/{patch}"
        raise NotFound(f"{e}; did you mean the model variant {variant} (vitkit info {variant})?") from None


# Formats that hold no class names of their own: Google's .npz files (their 1000 / 21843-way heads are
# ImageNet's, in the standard order) and timm state dicts without a label list.
_NAMELESS_FORMATS = ("official", "big_vision", "timm")


def _with_source_metadata(meta: CheckpointMeta, num_classes: int, found: Resolved) -> CheckpointMeta:
    """Add what the name told: the registry entry's labels and preprocessing, where it came from."""
    provenance = dict(meta.provenance)
    if found.kind != "local":
        provenance["resolved"] = {
            k: v
            for k, v in {"name": found.name, "kind": found.kind, "url": found.url, "repo_id": found.repo_id,
                         "revision": found.revision}.items()
            if v is not None
        }  # fmt: skip
    names = meta.class_names
    preprocess = meta.preprocess
    entry = found.entry
    if entry is not None:
        provenance["registry"] = {
            "name": entry.name, "top1": entry.top1, "top1_source": entry.top1_source, "source": entry.source,
        }  # fmt: skip
        if names is None and entry.num_classes == num_classes:
            names = label_names(entry.label_set)
        p = entry.preprocess
        preprocess = replace(
            preprocess, mean=tuple(p["mean"]), std=tuple(p["std"]), resize=p["resize"], interpolation=p["interpolation"]
        )
    elif found.family is not None:
        fam = found.family
        provenance["registry"] = {
            "name": fam.name, "family": fam.family, "embedding": fam.embedding, "source": fam.source,
            **({"load_options": fam.load_options} if fam.load_options else {}),
        }  # fmt: skip
    if entry is None and names is None and meta.format in _NAMELESS_FORMATS:
        label_set = label_set_for(num_classes)
        if label_set is not None:
            names = label_names(label_set)
            provenance["class_names"] = (
                f"{label_set} (shipped names: the file holds none, its head is {num_classes}-way)"
            )
    return replace(meta, class_names=names, preprocess=preprocess, provenance=provenance)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    pos_interpolation: str = "bilinear",
    cache_dir: str | os.PathLike[str] | None = None,
    lora_base: str | os.PathLike[str] | None = None,
) -> Loaded:
    """Load any supported checkpoint (a path, URL, registry name or hub id) as a ready model plus metadata.

    ``num_classes``: replace the head by a zero-initialised one for this many classes (dropping the
    pre-logits layer) when it differs from the checkpoint's. ``image_size``: change the resolution,
    resampling the position-embedding grid (``"bilinear"`` reproduces the official ``interpolate_posembed``
    exactly, ``"bicubic"`` is timm's choice). ``lora_base``: see :func:`read_checkpoint`.
    """
    ckpt = read_checkpoint(path, format, cache_dir=cache_dir, lora_base=lora_base)
    model = empty_model(ckpt.cfg)
    try:
        model.load_state_dict(ckpt.state, strict=True)
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors: one line naming the first
        detail = " ".join(str(e).split("\n", 2)[1:2]).strip().rstrip(".") or str(e).splitlines()[0]
        raise CheckpointError(f"{ckpt.meta.source}: weights do not match the config ({detail})") from None
    meta = ckpt.meta
    if num_classes is not None and num_classes != ckpt.cfg.num_classes:
        model.reset_head(num_classes)
        meta = replace(meta, class_names=None)
    if image_size is not None:
        try:
            model.resize_image(image_size, method=pos_interpolation)
        except ValueError as e:  # a size the patch stride does not divide
            raise ConfigError(f"{ckpt.meta.source}: image size {image_size}: {e}") from None
        meta = replace(meta, preprocess=replace(meta.preprocess, image_size=model.cfg.image_size))
    return Loaded(model.eval(), meta)


_LOAD_OPTIONS = ("format", "num_classes", "image_size", "pos_interpolation", "cache_dir", "lora_base")


def loaded_from(name_or_path: str | os.PathLike[str], *, device: str | None = None, **overrides: Any) -> Loaded:
    """A variant name ("B/16") or any checkpoint (path, URL, registry name, hub id) as a model plus metadata.

    A variant is freshly initialised with ``overrides`` (any ViTConfig field) and gets the default
    preprocessing at its resolution; a checkpoint goes through :func:`load_checkpoint`, which takes
    ``format``, ``num_classes``, ``image_size``, ``pos_interpolation`` and ``cache_dir``. ``None`` values
    are left out. ``device="meta"`` builds shapes only (no memory, no initialisation cost).
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if is_variant_name(name_or_path):
        with torch.device(device or "cpu"):
            model = create_model(os.fspath(name_or_path), **given)
        pre = Preprocess(image_size=model.cfg.image_size, grayscale=model.cfg.in_channels == 1)
        return Loaded(model.eval(), CheckpointMeta("variant", os.fspath(name_or_path), pre))
    unknown = sorted(set(given) - set(_LOAD_OPTIONS))
    if unknown:
        raise ConfigError(f"{name_or_path}: a checkpoint takes {', '.join(_LOAD_OPTIONS)}, not {', '.join(unknown)}")
    loaded = load_checkpoint(name_or_path, **given)
    return loaded if device is None else replace(loaded, model=loaded.model.to(device))


def model_from(name_or_path: str | os.PathLike[str], **overrides: Any) -> VisionTransformer:
    """A variant name or any checkpoint as a model: see :func:`loaded_from`."""
    return loaded_from(name_or_path, **overrides).model


def load_pretrained(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    pos_interpolation: str = "bilinear",
    cache_dir: str | os.PathLike[str] | None = None,
) -> VisionTransformer:
    """Load any supported checkpoint (a path, URL, registry name or hub id) as a ViT in eval mode; see
    :func:`load_checkpoint`."""
    return load_checkpoint(
        path,
        format=format,
        num_classes=num_classes,
        image_size=image_size,
        pos_interpolation=pos_interpolation,
        cache_dir=cache_dir,
    ).model


def _writable(format: str) -> tuple[Format, SaveFn]:
    """The format named ``format`` and its writer; ConfigError for an unknown or read-only one."""
    fmt = FORMATS.get(format)
    if fmt is None or fmt.save is None:
        writable = [f.name for f in FORMATS.values() if f.save is not None]
        raise ConfigError(f"cannot write format {format!r}; writable: {', '.join(writable)}")
    return fmt, fmt.save


def check_save_target(
    path: str | os.PathLike[str], format: str, *, overwrite: bool = False, inputs: tuple[str | None, ...] = ()
) -> Path:
    """Refuse, before any work, what :func:`save_checkpoint` would refuse for ``path`` in ``format``: an unknown or
    read-only format, an output that is, holds or lies inside one of ``inputs``, a folder vitkit did not write,
    an existing output without ``overwrite``, a place that cannot be written."""
    fmt, _ = _writable(format)
    out = Path(path)
    check_not_input(out, inputs)
    if fmt.check_output is not None:
        fmt.check_output(out, overwrite)
    return out


def save_checkpoint(
    model: VisionTransformer,
    path: str | os.PathLike[str],
    format: str = "vitkit",
    *,
    meta: CheckpointMeta | None = None,
    preprocess: Preprocess | None = None,
    class_names: list[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` in ``format``, keeping preprocessing and class names where the format can hold them.

    A format that cannot represent the model exactly (e.g. a hybrid as a Hugging Face folder) refuses with a
    CheckpointError saying why; nothing is written then. Nothing vitkit did not write is ever replaced: an
    existing file, or a folder vitkit wrote, only with ``overwrite=True``; any other non-empty folder, and a
    path that is, holds or lies inside the checkpoint ``meta`` was read from, are refused.
    """
    _, save = _writable(format)
    if meta is None:
        meta = CheckpointMeta(
            format="vitkit",
            source="(in memory)",
            preprocess=preprocess or Preprocess(image_size=model.cfg.image_size),
            class_names=class_names,
        )
    else:
        meta = replace(
            meta,
            preprocess=preprocess or meta.preprocess,
            class_names=class_names if class_names is not None else meta.class_names,
        )
    out = Path(path)
    check_not_input(out, [meta.source])
    return save(model, out, meta, overwrite=overwrite)


__all__ = [
    "FORMATS",
    "Checkpoint",
    "CheckpointMeta",
    "Format",
    "Loaded",
    "check_save_target",
    "detect_format",
    "empty_model",
    "expected_state",
    "is_variant_name",
    "load_checkpoint",
    "load_pretrained",
    "loaded_from",
    "model_from",
    "read_checkpoint",
    "save_checkpoint",
]
