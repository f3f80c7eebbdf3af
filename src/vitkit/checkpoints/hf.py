"""Hugging Face ``transformers`` ViT folders (``save_pretrained``): ``config.json`` + ``model.safetensors``.

Two weight layouts are read:

- the hub layout that every published checkpoint uses, and that transformers 5.x still writes on save:
  ``vit.embeddings.{cls_token,position_embeddings,patch_embeddings.projection}``,
  ``vit.encoder.layer.{i}.{layernorm_before, attention.attention.{query,key,value}, attention.output.dense,
  layernorm_after, intermediate.dense, output.dense}``, ``vit.layernorm``, ``classifier``;
- the in-memory names of transformers 5.x (``vit.layers.{i}.attention.{q,k,v,o}_proj``, ``mlp.fc1/fc2``), as
  in a raw ``state_dict()`` saved with safetensors.

``ViTForImageClassification`` keys carry a ``vit.`` prefix; a bare ``ViTModel`` has none and no classifier
(vitkit: ``num_classes=0``). ``ViTModel``'s pooler (Dense + tanh on the class token) is exactly vitkit's
pre-logits layer, so a ViTModel folder with a pooler loads as a model whose ``forward`` returns HF's
``pooler_output``. ``ViTForImageClassification`` never uses a pooler: one stored next to a classifier is
ignored (and reported in the provenance).

Config fields read: hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act (``gelu``
and ``gelu_python`` are exact; ``gelu_new``, ``gelu_pytorch_tanh``, ``gelu_fast`` are the tanh approximation),
layer_norm_eps (HF's default is 1e-12, not 1e-6), qkv_bias, image_size, patch_size, num_channels, id2label.
``preprocessor_config.json`` supplies image_mean/std, size and resample when present.

Other transformers model types are read and written by their own modules, registered in :func:`families`
by ``model_type`` (``hf_dino``: dinov2, dinov2_with_registers, deit; ``hf_dinov3``: dinov3_vit; ``hf_clip``:
clip_vision_model, clip, siglip_vision_model, siglip); :mod:`vitkit.checkpoints.hf_folder` dispatches on config.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.keymap import Rule, expand, from_state_dict, rule, stacked, weight_bias
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    check_preprocess,
    convert,
    export_state,
    require,
    with_learned_posemb,
)
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "hf"
CONFIG = "config.json"
PREPROCESSOR = "preprocessor_config.json"
GELU = {"gelu": "exact", "gelu_python": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# PIL resample codes used by HF image processors
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}
RESAMPLE_CODE = {v: k for k, v in RESAMPLE.items()}


@dataclass(frozen=True)
class Family:
    """Another transformers model type: its folder reader (given the parsed config.json), its writer, and which
    vitkit configs it writes (the first family that claims a model writes it; none: a ViT folder)."""

    load: Callable[[Path, Mapping[str, Any]], Checkpoint]
    save: Callable[[VisionTransformer, Path, CheckpointMeta | None, bool], Path]
    claims: Callable[[ViTConfig], bool]


def key_map(cfg: ViTConfig, prefix: str = "vit.", style: str = "hub") -> list[Rule]:
    """HF names for a model with this config; ``style`` "hub" (classic) or "v5" (transformers 5 in-memory)."""
    e = f"{prefix}embeddings."
    if style == "hub":
        layer = f"{prefix}encoder.layer.{{i}}."
        q, k, v = (f"{layer}attention.attention.{n}" for n in ("query", "key", "value"))
        o, fc1, fc2 = f"{layer}attention.output.dense", f"{layer}intermediate.dense", f"{layer}output.dense"
    else:
        layer = f"{prefix}layers.{{i}}."
        q, k, v, o = (f"{layer}attention.{n}_proj" for n in ("q", "k", "v", "o"))
        fc1, fc2 = f"{layer}mlp.fc1", f"{layer}mlp.fc2"
    rules: list[Rule] = [
        rule("cls_token", f"{e}cls_token"),
        rule("pos_embed", f"{e}position_embeddings"),
        *weight_bias("patch_embed.proj", f"{e}patch_embeddings.projection"),
        *weight_bias("blocks.{i}.norm1", f"{layer}layernorm_before"),
        stacked("blocks.{i}.attn.qkv.weight", [f"{n}.weight" for n in (q, k, v)]),
        *weight_bias("blocks.{i}.attn.proj", o),
        *weight_bias("blocks.{i}.norm2", f"{layer}layernorm_after"),
        *weight_bias("blocks.{i}.mlp.fc1", fc1),
        *weight_bias("blocks.{i}.mlp.fc2", fc2),
        *weight_bias("norm", f"{prefix}layernorm"),
    ]
    if cfg.qkv_bias:
        rules.append(stacked("blocks.{i}.attn.qkv.bias", [f"{n}.bias" for n in (q, k, v)]))
    if cfg.representation_size:
        rules += weight_bias("pre_logits.0", f"{prefix}pooler.dense")
    if cfg.num_classes > 0:
        rules += weight_bias("head", "classifier")
    return expand(rules, cfg.depth)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return doc


def _pair(value: Any, what: str, source: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise CheckpointError(f"{source}: invalid {what} {value!r}")


def gelu_of(doc: Mapping[str, Any], source: str, known: Mapping[str, str] = GELU) -> str:
    """vitkit's GELU for config.json's ``hidden_act`` (default "gelu"), by ``known`` (transformers' activation names
    -> vitkit's); an activation vitkit lacks is refused."""
    act = doc.get("hidden_act", "gelu")
    if act not in known:
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (known: {', '.join(known)})")
    return known[act]


def config_from_hf(doc: Mapping[str, Any], weights: Mapping[str, Any], prefix: str, source: str) -> ViTConfig:
    """vitkit's config from an HF config.json (plus the weights, for head and pooler presence)."""
    gelu = gelu_of(doc, source)
    ph, pw = _pair(doc.get("patch_size", 16), "patch_size", source)
    if ph != pw:
        raise CheckpointError(f"{source}: non-square patches {ph}x{pw} are not supported")
    num_classes = int(weights["classifier.weight"].shape[0]) if "classifier.weight" in weights else 0
    rep = None
    pooler = f"{prefix}pooler.dense.weight"
    if pooler in weights and num_classes == 0:
        if doc.get("pooler_act", "tanh") != "tanh":
            raise CheckpointError(f"{source}: pooler_act {doc.get('pooler_act')!r} is not supported (only tanh)")
        rep = int(weights[pooler].shape[0])
    try:
        return ViTConfig(
            image_size=_pair(doc.get("image_size", 224), "image_size", source),
            patch_size=ph,
            in_channels=int(doc.get("num_channels", 3)),
            num_classes=num_classes,
            hidden_size=int(doc.get("hidden_size", 768)),
            depth=int(doc.get("num_hidden_layers", 12)),
            num_heads=int(doc.get("num_attention_heads", 12)),
            mlp_dim=int(doc.get("intermediate_size", 3072)),
            classifier="token",
            representation_size=rep,
            gelu=gelu,  # type: ignore[arg-type]
            layer_norm_eps=float(doc.get("layer_norm_eps", 1e-12)),
            qkv_bias=bool(doc.get("qkv_bias", True)),
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def class_names_from(doc: Mapping[str, Any], num_classes: int) -> list[str] | None:
    """id2label as a list; None when absent or HF's placeholder names (LABEL_0, ...)."""
    id2label = doc.get("id2label") or {}
    try:
        names = [str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in range(num_classes)]
    except (KeyError, IndexError, TypeError):  # missing names, or not the mapping HF writes (a list, a number)
        return None
    if not names or names == [f"LABEL_{i}" for i in range(num_classes)]:
        return None
    return names


def preprocess_from(folder: Path, image_size: tuple[int, int]) -> Preprocess:
    """HF ViTImageProcessor settings (resize straight to size, rescale 1/255, normalise) as a Preprocess."""
    path = folder / PREPROCESSOR
    if not path.is_file():
        return Preprocess(image_size=image_size, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # HF ViT defaults
    doc = _read_json(path)
    size = doc.get("size", image_size)
    if isinstance(size, dict):
        size = (size.get("height", image_size[0]), size.get("width", image_size[1]))
    mean = doc.get("image_mean", IMAGENET_MEAN) if doc.get("do_normalize", True) else (0.0, 0.0, 0.0)
    std = doc.get("image_std", IMAGENET_STD) if doc.get("do_normalize", True) else (1.0, 1.0, 1.0)
    try:
        return Preprocess(
            image_size=_pair(list(size) if isinstance(size, tuple) else size, "size", str(path)),
            mean=tuple(mean),
            std=tuple(std),
            resize="squash",
            interpolation=RESAMPLE.get(int(doc.get("resample", 2)), "bilinear"),
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _style(weights: Mapping[str, Any], prefix: str, source: str) -> str:
    if any(k.startswith(f"{prefix}encoder.layer.") for k in weights):
        return "hub"
    if any(k.startswith(f"{prefix}layers.") for k in weights):
        return "v5"
    raise CheckpointError(f"{source}: no encoder layers ({prefix}encoder.layer.* or {prefix}layers.*) in the weights")


def parse_config(path: Path, build: Callable[[], ViTConfig]) -> ViTConfig:
    """``build()``, a wrong-typed field of the folder's config.json (null, lists ...) one line naming the file."""
    try:
        return build()
    except (TypeError, ValueError, OverflowError, AttributeError, KeyError) as e:
        raise CheckpointError(f"{path / CONFIG}: invalid config ({type(e).__name__}: {e})") from None


def checkpoint(
    path: Path,
    cfg: ViTConfig,
    state: dict[str, torch.Tensor],
    provenance: dict[str, Any],
    preprocess: Callable[[], Preprocess],
    doc: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """A transformers folder's checkpoint: its preprocessing (``preprocess()``) and, given config.json's ``doc``, its
    class names (a wrong-typed field: one line); the preprocessing checked against the model (``check_preprocess``)."""
    try:
        pre = preprocess()
        names = class_names_from(doc, cfg.num_classes) if doc is not None else None
    except (TypeError, ValueError, OverflowError, AttributeError, KeyError) as e:
        what = "labels or preprocessing" if doc is not None else "preprocessing"
        raise CheckpointError(f"{path}: invalid {what} config ({type(e).__name__}: {e})") from None
    pre_file = path / PREPROCESSOR
    check_preprocess(cfg, pre, str(pre_file if pre_file.is_file() else path / CONFIG))
    return Checkpoint(cfg, state, CheckpointMeta(FORMAT, str(path), pre, names, provenance))


def provenance(layout: str, doc: Mapping[str, Any], ignored: list[str] | str | None) -> dict[str, Any]:
    """A transformers folder's provenance: its ``layout``, config.json's architectures, and what of the weights was
    ``ignored`` (when anything was)."""
    out: dict[str, Any] = {"layout": layout, "architectures": doc.get("architectures")}
    if ignored:
        out["ignored"] = ignored
    return out


def load(path: Path) -> Checkpoint:
    """Read an HF ViT folder into vitkit's layout, shape-checked, with config, labels and preprocessing."""
    doc = _read_json(path / CONFIG)
    weights = torch_files.read_folder_weights(path)
    prefix = "vit." if any(k.startswith("vit.") for k in weights) else ""
    cfg = parse_config(path, lambda: config_from_hf(doc, weights, prefix, str(path)))
    ignored = {f"{prefix}embeddings.mask_token"}  # used only for masked image modelling inputs
    if cfg.num_classes > 0:
        ignored |= {f"{prefix}pooler.dense.weight", f"{prefix}pooler.dense.bias"}  # unused by the classifier
    rules = lambda c: key_map(c, prefix, _style(weights, prefix, str(path)))  # noqa: E731
    state = convert(cfg, weights, str(path), rules, ignore=lambda k: k in ignored)
    style = _style(weights, prefix, str(path))
    layout = f"transformers {'ViTForImageClassification' if prefix else 'ViTModel'} ({style} names)"
    about = provenance(layout, doc, sorted(k for k in ignored if k in weights))
    return checkpoint(path, cfg, state, about, lambda: preprocess_from(path, cfg.image_size), doc)


def hf_config(cfg: ViTConfig, class_names: list[str] | None) -> dict[str, Any]:
    """config.json for ``transformers.ViTConfig``."""
    arch = "ViTForImageClassification" if cfg.num_classes > 0 else "ViTModel"
    doc: dict[str, Any] = {
        "architectures": [arch],
        "model_type": "vit",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.layer_norm_eps,
        "image_size": cfg.image_size[0] if cfg.image_size[0] == cfg.image_size[1] else list(cfg.image_size),
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_channels,
        "qkv_bias": cfg.qkv_bias,
        "encoder_stride": cfg.patch_size,
        "pooler_act": "tanh",
        "pooler_output_size": cfg.representation_size or cfg.hidden_size,
        "dtype": "float32",
    }
    if cfg.num_classes > 0:
        names = class_names or [f"LABEL_{i}" for i in range(cfg.num_classes)]
        doc["id2label"] = {str(i): n for i, n in enumerate(names)}
        doc["label2id"] = {n: i for i, n in enumerate(names)}
    return doc


def processor_fields(pre: Preprocess) -> dict[str, Any]:
    """The fields of ``pre`` that every transformers image processor config writes alike: resample, the rescale by
    1/255, mean and std."""
    return {
        "resample": RESAMPLE_CODE[pre.interpolation],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(pre.mean),
        "image_std": list(pre.std),
    }


def preprocessor_config(pre: Preprocess) -> dict[str, Any]:
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": pre.image_size[0], "width": pre.image_size[1]},
        **processor_fields(pre),
    }


def unrepresentable(cfg: ViTConfig) -> str | None:
    """Why transformers' ViT cannot compute the function of a model with this config (None when it can)."""
    if cfg.resnet_layers is not None:
        return "transformers' ViT has no hybrid ResNet stem"
    if cfg.rope is not None:
        return f"transformers' ViT has no RoPE (this model has {cfg.rope!r})"
    if cfg.classifier != "token":
        return "transformers' ViT pools the class token; this model uses GAP (classifier 'gap')"
    if cfg.num_classes > 0 and cfg.representation_size:
        return "ViTForImageClassification has no pre-logits layer (reset the head, or export with num_classes=0)"
    return None


def transformers_state(
    model: VisionTransformer, prefix: str = "vit.", style: str = "hub"
) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """``model``'s weights under transformers' names (``style`` as in :func:`key_map`), with the config they
    describe (a sin-cos table stored as a learned one: the same function). The caller checks
    :func:`unrepresentable` first."""
    cfg, state = with_learned_posemb(model.cfg, export_state(model))
    return cfg, torch_files.from_arrays(from_state_dict(key_map(cfg, prefix, style), state))


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write ``model`` as an HF folder that ``transformers`` loads unchanged (hub layout names).

    ``num_classes > 0``: ``ViTForImageClassification`` (no pre-logits layer allowed: HF's classifier has none).
    ``num_classes == 0``: ``ViTModel``; a pre-logits layer becomes its pooler, otherwise load it with
    ``ViTModel.from_pretrained(..., add_pooling_layer=False)``. The preprocessing is written when it is a
    plain resize (HF's ViTImageProcessor cannot centre-crop). The other families' models are written by
    their own modules (:func:`vitkit.checkpoints.hf_folder.save` chooses).
    """
    torch_files.check_folder_output(Path(path), overwrite)
    why = unrepresentable(model.cfg)
    require(why is None, "a transformers ViT folder", why or "")
    cfg, tensors = transformers_state(model, "vit." if model.cfg.num_classes > 0 else "", "hub")
    pre = meta.preprocess if meta else Preprocess(image_size=cfg.image_size)
    processor = preprocessor_config(pre) if pre.resize == "squash" else None
    return write_folder(path, tensors, hf_config(cfg, meta.class_names if meta else None), processor, overwrite)


def write_folder(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    doc: Mapping[str, Any],
    pre: Mapping[str, Any] | None,
    overwrite: bool,
) -> Path:
    """A transformers folder, atomically: the weights, config.json ``doc`` and preprocessor_config.json ``pre`` (none
    where the family's image processor cannot compute the preprocessing)."""
    files = {CONFIG: json.dumps(doc, indent=2) + "\n"}
    if pre is not None:
        files[PREPROCESSOR] = json.dumps(pre, indent=2) + "\n"
    return torch_files.write_folder(path, tensors, files, overwrite=overwrite)
