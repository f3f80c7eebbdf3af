"""LoRA adapters kept apart from their base checkpoint (``vitkit finetune --method lora --save-adapters``).

A folder of four files::

    config.json                 {"format": "vitkit-lora", "version": 1, "base": {"checkpoint", "digest",
                                 "pos_interpolation"}, "lora": {rank, alpha, dropout, targets},
                                 "model": {...}, "preprocess": {...}, "class_names": [...], "provenance": {...}}
    adapter_config.json         the adapters' ``peft.LoraConfig`` (peft's own file, written without peft:
                                 :func:`adapter_config`)
    adapter_model.safetensors   the adapters, in peft's names (``blocks.0.attn.qkv.lora_A.weight``, ...)
    head.safetensors            what was trained besides them: the head (and pre-logits layer, if any)

Loading (every command: it is a checkpoint format, ``lora``) reads the base checkpoint named in config.json
(or ``base=``, ``load_checkpoint(lora_base=)``), checks that its weights are the ones the adapters were trained
on (``state_digest``), brings it to the fine-tuned resolution and head, injects the adapters, loads them and
the head, and merges them into the weights: the model every tool gets is a plain ViT. A remote base (a URL, a
Hugging Face Hub id) is fetched only when the user names it (``lora_base=``) or has downloaded it already; a
registry name is fetched (its digest is published); every size in config.json is bounded before anything is
allocated (:data:`MAX_TOKENS`, ``LoraSpec``'s rank, the head file's header). By hand, with peft::

    base = vitkit.load_checkpoint(BASE, image_size=...).model; base.reset_head(len(class_names))
    peft.inject_adapter_in_model(peft.LoraConfig.from_pretrained(FOLDER), base)
    peft.set_peft_model_state_dict(base, safetensors.torch.load_file(FOLDER/"adapter_model.safetensors"))
    base.load_state_dict(safetensors.torch.load_file(FOLDER/"head.safetensors"), strict=False)
"""

from __future__ import annotations

import contextvars
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vitkit import fileio, output_paths
from vitkit.checkpoints import torch_files
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, Loaded, state_digest
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import CheckpointError, VitkitError
from vitkit.hub import registry
from vitkit.hub.download import is_cached, is_url
from vitkit.hub.resolve import is_hub_cached, looks_like_path, parse_hub_id
from vitkit.models.lora import LoraSpec, adapter_state, add_lora, load_adapter_state, merge_lora
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "vitkit-lora"
VERSION = 1
CONFIG = "config.json"
PEFT_CONFIG = "adapter_config.json"
ADAPTERS = "adapter_model.safetensors"
HEAD = "head.safetensors"
FILES = (CONFIG, PEFT_CONFIG, ADAPTERS, HEAD)
MAX_TENSOR_VALUES = 1 << 31  # far above any adapter set or head; checked from the header before reading
MAX_CONFIG_BYTES = 16 << 20  # config.json: a few KB, class names included
#: peft's version whose ``LoraConfig.to_dict()`` :func:`adapter_config` reproduces (tested field by field)
PEFT_VERSION = "0.21.2"
#: Tokens of the adapted model's resolution (its image size over the patch size): the base's position
#: embedding is resampled to it before anything else can be checked. 16,384 is 2048x2048 pixels at /16.
MAX_TOKENS = 1 << 14
_LOADING_BASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("lora_base", default=None)


class RemoteBase(CheckpointError):
    """An adapter folder that names a remote base (a URL or a Hugging Face Hub id) the user did not name."""


class LoraChain(CheckpointError):
    """An adapter folder whose base is an adapter folder (itself, or another): refused, never followed."""


def looks_like(path: Path) -> bool:
    return torch_files.folder_config(path, MAX_CONFIG_BYTES).get("format") == FORMAT


def trained_rest(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The head and pre-logits tensors: what a LoRA run trains besides the adapters."""
    return {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if k.startswith(("head.", "pre_logits."))
    }


def save(
    model: VisionTransformer,
    path: str | os.PathLike[str],
    *,
    base: str,
    base_digest: str,
    spec: LoraSpec,
    pos_interpolation: str = "bilinear",
    preprocess: Preprocess | None = None,
    class_names: list[str] | None = None,
    provenance: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an adapted model (``add_lora``) as an adapter folder, atomically. ``base``: the checkpoint the
    adapters were trained on, as ``load_checkpoint`` takes it (a local path is stored absolute);
    ``base_digest``: its ``state_digest`` as loaded at its own resolution and head."""
    out = Path(path)
    output_paths.check_output_dir(out, allowed=FILES, owned=looks_like, overwrite=overwrite, what="LoRA adapter folder")
    local = Path(base)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "base": {
            "checkpoint": str(local.resolve()) if local.exists() else base,
            "digest": base_digest,
            "pos_interpolation": pos_interpolation,
        },
        "lora": spec.to_dict(),
        "model": model.cfg.to_dict(),
        "preprocess": (preprocess or Preprocess(image_size=model.cfg.image_size)).to_dict(),
        "class_names": class_names,
        "provenance": provenance or {},
    }
    adapters, rest = adapter_state(model), trained_rest(model)
    marker = {"format": "pt", fileio.WRITER_KEY: fileio.WRITER}

    def write(tmp: Path) -> None:
        save_file(adapters, str(tmp / ADAPTERS), metadata=marker)
        save_file(rest, str(tmp / HEAD), metadata=marker)
        (tmp / PEFT_CONFIG).write_text(json.dumps(adapter_config(spec), indent=2, sort_keys=True) + "\n")
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")

    return fileio.write_dir_atomic(out, write)


def adapter_config(spec: LoraSpec) -> dict[str, Any]:
    """adapter_config.json's fields: ``spec.peft_config().to_dict()`` as JSON (peft :data:`PEFT_VERSION`'s every
    field, its enums as strings), without importing peft."""
    unset = [
        *("alora_invocation_tokens", "arrow_config", "auto_mapping", "base_model_name_or_path", "corda_config"),
        *("eva_config", "exclude_modules", "kasa_config", "layer_replication", "layers_pattern"),
        *("layers_to_transform", "lora_ga_config", "megatron_config", "modules_to_save", "monteclora_config"),
        *("revision", "target_parameters", "task_type", "trainable_token_indices", "use_bdlora", "velora_config"),
    ]
    doc: dict[str, Any] = dict.fromkeys(unset)
    doc.update(alpha_pattern={}, rank_pattern={}, loftq_config={}, bias="none", ensure_weight_tying=False)
    doc.update(fan_in_fan_out=False, inference_mode=False, init_lora_weights=True, lora_bias=False)
    doc.update(megatron_core="megatron.core", peft_type="LORA", peft_version=PEFT_VERSION, qalora_group_size=16)
    doc.update(use_dora=False, use_qalora=False, use_rslora=False)
    doc.update(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.pattern())
    return doc


def read_config(path: Path) -> dict[str, Any]:
    """config.json of an adapter folder, its fields checked."""
    cfg_path = path / CONFIG
    try:
        with open(cfg_path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{cfg_path}: more than {MAX_CONFIG_BYTES >> 20} MiB, not an adapter config")
        doc = json.loads(text)
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: no such file") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable ({e})") from None
    try:
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"{cfg_path}: not a vitkit LoRA adapter folder")
        base = doc["base"]
        if not (isinstance(base.get("checkpoint"), str) and isinstance(base.get("digest"), str)):
            raise CheckpointError(f'{cfg_path}: "base" must name the base checkpoint and its digest')
        doc["_spec"] = LoraSpec.from_dict(doc["lora"])
        doc["_cfg"] = ViTConfig.from_dict(doc["model"])
        doc["_preprocess"] = Preprocess.from_dict(doc.get("preprocess") or {"image_size": doc["_cfg"].image_size})
        names = doc.get("class_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f'{cfg_path}: "class_names" must be a list of strings')
        cfg, spec = doc["_cfg"], doc["_spec"]
        if spec.rank > cfg.hidden_size:
            raise CheckpointError(f"{cfg_path}: LoRA rank {spec.rank} is above the model's width {cfg.hidden_size}")
        tokens = cfg.grid_size[0] * cfg.grid_size[1]
        if tokens > MAX_TOKENS:
            raise CheckpointError(
                f"{cfg_path}: image size {cfg.image_size} is {tokens} tokens, more than the {MAX_TOKENS} an adapted "
                "model may have"
            )
        pre = doc["_preprocess"].image_size
        if tuple(pre) != tuple(cfg.image_size):
            raise CheckpointError(f'{cfg_path}: "preprocess" image size {pre} is not the model\'s {cfg.image_size}')
        if not isinstance(doc.get("provenance") or {}, dict):
            raise CheckpointError(f'{cfg_path}: "provenance" must be an object')
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, VitkitError) as e:
        raise CheckpointError(f"{cfg_path}: invalid LoRA adapter config ({type(e).__name__}: {e})") from None
    return doc


def _shapes(path: Path) -> dict[str, list[int]]:
    """The tensor shapes in a safetensors file's header (nothing else read)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            return {k: list(f.get_slice(k).get_shape()) for k in names}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, their sizes checked from the header before anything is read."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            total = sum(math.prod(f.get_slice(k).get_shape()) for k in names)
            if total > MAX_TENSOR_VALUES:
                raise CheckpointError(f"{path}: {total:,} values, more than any adapter set holds")
            return {k: f.get_tensor(k) for k in names}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def check_declared_base(path: Path, name: str) -> None:
    """RemoteBase unless the base that the folder's config.json names (not the user) may be read: a local path,
    a registry name (vitkit's own list of Google's checkpoints, digests published), or a URL or Hub id already
    downloaded (``vitkit download``: the user fetched it; for a Hub id, config.json and weights in the Hub cache).
    A URL or Hub id only the folder names is never fetched: whoever wrote the folder would choose what is downloaded."""
    if os.path.exists(name) or (not is_url(name) and looks_like_path(name)):
        return  # local: a missing path is "no such file" below, never a download
    if is_url(name):
        if is_cached(name):
            return
    elif registry.lookup(name) is not None:
        return
    elif (hub := parse_hub_id(name)) is not None:
        if is_hub_cached(*hub):
            return
    else:
        return  # neither remote nor a registry name: the loader's "not found" says what was tried
    raise RemoteBase(
        f"{path / CONFIG}: its base checkpoint {name} is remote and named by the adapter folder, not by you; "
        f"it is not fetched: download it yourself (vitkit download {name}) if you trust it, or name a local copy "
        "with lora_base="
    )


def load(path: Path, base: str | os.PathLike[str] | None = None, *, load_base: Callable[[str], Loaded]) -> Checkpoint:
    """The merged model of an adapter folder and its base checkpoint (``base``: another place to find it), read
    by ``load_base`` (the package's ``load_checkpoint``, which passes itself: any format can be a base)."""
    outer = _LOADING_BASE.get()
    if outer is not None:  # this folder is the base of another adapter folder: never a chain, nor a loop
        raise LoraChain(f"{outer}: its base checkpoint {path} is itself a LoRA adapter folder; name a full checkpoint")
    doc = read_config(path)
    cfg: ViTConfig = doc["_cfg"]
    spec: LoraSpec = doc["_spec"]
    base_name = os.fspath(base) if base is not None else doc["base"]["checkpoint"]
    if base is None:
        check_declared_base(path, base_name)
    head_rows = _shapes(path / HEAD).get("head.weight", [0])[0]
    if head_rows != cfg.num_classes:  # the head file, not the config, sizes the new head
        raise CheckpointError(f"{path / HEAD}: does not hold the head of a {cfg.num_classes}-class model")
    token = _LOADING_BASE.set(str(path))
    try:
        loaded = load_base(base_name)
    except LoraChain:
        raise
    except VitkitError as e:
        raise CheckpointError(f"{path}: its base checkpoint {base_name} cannot be loaded ({e})") from None
    finally:
        _LOADING_BASE.reset(token)
    model = loaded.model
    if state_digest(model.state_dict()) != doc["base"]["digest"]:
        raise CheckpointError(
            f"{path}: the base checkpoint {base_name} is not the one these adapters were trained on (its weights "
            "differ); name the original with base="
        )
    if model.cfg.image_size != cfg.image_size:
        model.resize_image(cfg.image_size, method=doc["base"].get("pos_interpolation", "bilinear"))
    model.reset_head(cfg.num_classes, keep_pre_logits=cfg.representation_size is not None)
    regularisation = ("dropout", "attention_dropout", "drop_path", "name", "extra")  # training-only differences
    got, want = ({k: v for k, v in c.to_dict().items() if k not in regularisation} for c in (model.cfg, cfg))
    if got != want:
        bad = next(k for k in want if got.get(k) != want[k])
        raise CheckpointError(f"{path}: the adapted model's {bad} does not follow from its base checkpoint")
    add_lora(model, spec)
    load_adapter_state(model, _read_tensors(path / ADAPTERS), str(path / ADAPTERS))
    rest, expected = _read_tensors(path / HEAD), trained_rest(model)
    if set(rest) != set(expected) or any(rest[k].shape != v.shape for k, v in expected.items()):
        raise CheckpointError(f"{path / HEAD}: does not hold the head of a {cfg.num_classes}-class model")
    model.load_state_dict(rest, strict=False)
    merge_lora(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    meta = CheckpointMeta(
        format="lora",
        source=str(path),
        preprocess=doc["_preprocess"],
        class_names=doc.get("class_names"),
        provenance={**(doc.get("provenance") or {}), "base": doc["base"]["checkpoint"], "lora": spec.to_dict()},
    )
    return Checkpoint(cfg, state, meta)
