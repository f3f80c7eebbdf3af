"""timm ``VisionTransformer`` state dicts: a ``.safetensors`` or ``.pth`` file, or a timm hub folder.

Names (timm's fused-qkv layout, nearly vitkit's own)::

    patch_embed.proj.{weight,bias}  cls_token (1, 1, D)  pos_embed (1, [1 +] N, D)
    blocks.{i}.norm1, attn.qkv (3D, D), attn.proj, norm2, mlp.fc1, mlp.fc2
    norm    head    pre_logits.fc (older timm, representation layer + tanh)

Semantics, from timm's ``vision_transformer.py``:

- ``pos_embed`` with ``1 + N`` entries is added after the class token is prepended (vitkit's layout); with
  ``N`` entries (``no_embed_class=True``: DeiT-3, big_vision ports) it is added to the patches only, which
  vitkit represents exactly with a zero class slot.
- global_pool "token" reads the class token after ``norm``; a model without class token and with ``norm``
  (``global_pool="avg", fc_norm=False``) normalises every token, then averages: vitkit's "gap".
- ``fc_norm`` (timm's default for global_pool="avg"/MAE fine-tunes) normalises the *pooled* vector instead of
  every token. LN(mean(x)) is a different function from mean(LN(x)), and vitkit's ViT has no such layer, so
  such checkpoints are refused, as are register tokens, layer scale, qk-norm, pre-norm, attention pooling and
  hybrid (ResNet) stems: each would be a silently different model.
- GELU is exact (nn.GELU), LayerNorm eps 1e-6. The number of heads does not show in any shape: it comes
  from the sidecar config (``model_args.num_heads``) or the paper's widths (Ti 3, S 6, B 12, L 16, H 16;
  otherwise width / 64), or ``num_heads=`` in :func:`load`.

A timm hub folder is ``config.json`` (``architecture``, ``model_args``, ``pretrained_cfg``, ``label_names``)
plus ``model.safetensors``; for a single file, a ``config.json`` with an ``architecture`` key beside it is used.
``.safetensors`` files written by vitkit carry that config in their metadata (timm ignores it), so heads,
GELU kind, LayerNorm eps, image size and labels survive; a bare ``.pth`` is written only when the shapes and
timm's defaults determine the model.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.base import (
    Checkpoint,
    CheckpointMeta,
    check_fits_file,
    expected_state,
    export_state,
    require,
    with_learned_posemb,
)
from vitkit.checkpoints.keymap import Array, Rule, expand, from_state_dict, rule, to_state_dict
from vitkit.checkpoints.preprocess import INCEPTION_MEAN, INCEPTION_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.fileio import WRITER, WRITER_KEY, check_output_file, write_file_atomic
from vitkit.models.posembed import grid_side
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "timm"
SUFFIXES = (".safetensors", *torch_files.PICKLE_SUFFIXES)
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
UNSUPPORTED = {
    "fc_norm.": "fc_norm (LayerNorm on the pooled vector, timm global_pool='avg')",
    "reg_token": "register tokens",
    "norm_pre.": "pre-norm (CLIP-style norm_pre)",
    "attn_pool.": "attention pooling (global_pool='map')",
    ".ls1.": "layer scale",
    ".attn.q_norm.": "qk-norm",
    "dist_token": "distillation token (DeiT)",
    "patch_embed.backbone.": "hybrid ResNet stem (load the official .npz instead)",
}
_LINEARS = ["norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]


def key_map(cfg: ViTConfig, *, no_embed_class: bool = False) -> list[Rule]:
    """timm names for a model with this config (blocks expanded)."""
    rules: list[Rule] = [rule("patch_embed.proj.weight", "patch_embed.proj.weight")]
    rules.append(rule("patch_embed.proj.bias", "patch_embed.proj.bias"))
    for name in _LINEARS:
        rules.append(rule(f"blocks.{{i}}.{name}.weight", f"blocks.{{i}}.{name}.weight"))
        if name != "attn.qkv" or cfg.qkv_bias:
            rules.append(rule(f"blocks.{{i}}.{name}.bias", f"blocks.{{i}}.{name}.bias"))
    rules += [rule("norm.weight", "norm.weight"), rule("norm.bias", "norm.bias")]
    if cfg.classifier == "token":
        rules.append(rule("cls_token", "cls_token"))
    if cfg.pos_embed == "learned":
        if no_embed_class and cfg.classifier == "token":
            rules.append(rule("pos_embed", "pos_embed", _with_zero_slot, _without_slot))
        else:
            rules.append(rule("pos_embed", "pos_embed"))
    if cfg.representation_size:
        rules += [rule(f"pre_logits.0.{p}", f"pre_logits.fc.{p}") for p in ("weight", "bias")]
    if cfg.num_classes > 0:
        rules += [rule("head.weight", "head.weight"), rule("head.bias", "head.bias")]
    return expand(rules, cfg.depth)


def _with_zero_slot(pe: Array) -> Array:
    return np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)


def _without_slot(pe: Array) -> tuple[Array]:
    return (pe[:, 1:],)


def _weights_path(path: Path) -> Path | None:
    if path.is_file() and path.suffix in SUFFIXES:
        return path
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return path / name
    return None


META_KEY = "vitkit.timm_config"  # vitkit writes the timm config into a .safetensors file's metadata too


def _sidecar(path: Path) -> dict[str, Any] | None:
    """timm's config.json (folder, or beside a single file), else the one vitkit embedded in a .safetensors."""
    cfg = path / "config.json" if path.is_dir() else path.with_name("config.json")
    texts: list[str] = []
    if cfg.is_file():
        with contextlib.suppress(OSError):
            texts.append(cfg.read_text())
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        with contextlib.suppress(SafetensorError, OSError), safe_open(str(path), "pt") as f:
            texts.append((f.metadata() or {}).get(META_KEY) or "")
    for text in texts:
        with contextlib.suppress(ValueError):
            doc = json.loads(text) if text else None
            if isinstance(doc, dict) and "architecture" in doc:
                return doc
    return None


def looks_like(path: Path) -> bool:
    """A timm state dict: keys ``patch_embed.proj.weight`` and ``blocks.0.attn.qkv.weight``."""
    if path.is_dir() and _sidecar(path) is None:
        return False  # a folder is timm's only with its config.json (HF and vitkit folders have their own)
    weights = _weights_path(path)
    if weights is None:
        return False
    try:
        keys = _keys(weights)
    except CheckpointError:
        return False
    return "patch_embed.proj.weight" in keys and "blocks.0.attn.qkv.weight" in keys


def _keys(path: Path) -> set[str]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                return set(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    return set(torch_files.read_state_file(path))


def infer_config(
    weights: Mapping[str, torch.Tensor],
    sidecar: Mapping[str, Any] | None,
    source: str,
    *,
    num_heads: int | None = None,
    gelu: str | None = None,
    layer_norm_eps: float | None = None,
    image_size: tuple[int, int] | None = None,
) -> tuple[ViTConfig, bool]:
    """(config, no_embed_class) from shapes, the optional sidecar config and explicit overrides."""
    for marker, what in UNSUPPORTED.items():
        if any(marker in k or k.startswith(marker) for k in weights):
            raise CheckpointError(f"{source}: timm {what} is not supported by vitkit's ViT")
    args: dict[str, Any] = dict((sidecar or {}).get("model_args") or {})
    pool = args.get("global_pool", (sidecar or {}).get("global_pool"))
    try:
        w = weights["patch_embed.proj.weight"]
        fc1 = weights["blocks.0.mlp.fc1.weight"]
    except KeyError as e:
        raise CheckpointError(f"{source}: not a complete timm ViT state dict, missing {e.args[0]}") from None
    D, C, P, P2 = (int(n) for n in w.shape)
    if P != P2:
        raise CheckpointError(f"{source}: non-square patches {P}x{P2} are not supported")
    token = "cls_token" in weights
    if token and pool not in (None, "token"):
        raise CheckpointError(f"{source}: global_pool={pool!r} with a class token is not vitkit's ViT (token or GAP)")
    if not token and pool not in (None, "avg"):
        raise CheckpointError(f"{source}: global_pool={pool!r} is not supported (token or avg)")
    depth = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    heads = num_heads or args.get("num_heads") or HEADS_BY_WIDTH.get(D) or max(D // 64, 1)
    if "pos_embed" not in weights:
        raise CheckpointError(f"{source}: no pos_embed (models without position embedding are not supported)")
    n = int(weights["pos_embed"].shape[1])
    size = image_size or args.get("img_size") or ((sidecar or {}).get("pretrained_cfg") or {}).get("input_size", [])[1:]
    image, no_embed_class = _grid_layout(n, token, P, size, args.get("no_embed_class"), source)
    try:
        cfg = ViTConfig(
            image_size=image,
            patch_size=P,
            in_channels=C,
            num_classes=int(weights["head.weight"].shape[0]) if "head.weight" in weights else 0,
            hidden_size=D,
            depth=depth,
            num_heads=int(heads),
            mlp_dim=int(fc1.shape[0]),
            classifier="token" if token else "gap",
            representation_size=int(weights["pre_logits.fc.weight"].shape[0])
            if "pre_logits.fc.weight" in weights
            else None,
            gelu=gelu or ("tanh" if args.get("act_layer") in ("gelu_tanh", "gelu_new") else "exact"),  # type: ignore[arg-type]
            layer_norm_eps=layer_norm_eps
            if layer_norm_eps is not None
            else (sidecar or {}).get("layer_norm_eps", 1e-6),
            qkv_bias="blocks.0.attn.qkv.bias" in weights,
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return cfg, no_embed_class


def _square(n: int) -> bool:
    return n > 0 and int(np.sqrt(n)) ** 2 == n


def _grid_layout(
    n: int, token: bool, patch: int, size: Any, no_embed_class: Any, source: str
) -> tuple[tuple[int, int], bool]:
    """(image size, no_embed_class) for a ``pos_embed`` of ``n`` entries.

    With an image size (timm's config: ``model_args.img_size`` or ``pretrained_cfg.input_size``; or given),
    the grid is known and the entry count says whether the class token has a slot. Without one, only a
    square grid can be assumed, and ``n`` entries with a class token are ambiguous when ``n`` is a square:
    a sqrt(n) x sqrt(n) grid with no class slot (timm ``no_embed_class``), or a class slot plus a non-square
    grid of n - 1 (a 32x48 image with 8 px patches: 1 + 24 = 25) -- refused rather than guessed.
    """
    if isinstance(size, int) or (isinstance(size, (list, tuple)) and len(size) == 2):
        image = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if image[0] % patch or image[1] % patch:
            raise CheckpointError(f"{source}: image size {image} is not a multiple of the patch size {patch}")
        grid = (image[0] // patch) * (image[1] // patch)
        if not token and n == grid:
            return image, False
        if token and n in (grid, grid + 1) and (no_embed_class is None or bool(no_embed_class) == (n == grid)):
            return image, n == grid
        raise CheckpointError(
            f"{source}: pos_embed has {n} entries, but the image size {image} with {patch} px patches gives "
            f"{grid} grid tokens{' (plus a class slot unless no_embed_class)' if token else ''}"
        )
    if token and no_embed_class is None and _square(n) and n > 1:
        raise CheckpointError(
            f"{source}: {n} position entries are either a {math.isqrt(n)}x{math.isqrt(n)} grid with no class slot "
            f"(timm no_embed_class) or a class slot plus a non-square grid of {n - 1}; put timm's config.json "
            "(model_args.img_size) beside the weights, or pass image_size to timm_format.load"
        )
    nec = bool(no_embed_class) if token and no_embed_class is not None else False
    grid_tokens = n - (1 if token and not nec else 0)
    try:
        side = grid_side(grid_tokens)
    except ValueError:
        raise CheckpointError(
            f"{source}: {grid_tokens} position tokens are not a square grid and no config gives the image size"
        ) from None
    return (side * patch, side * patch), nec


def preprocess_from(sidecar: Mapping[str, Any] | None, image_size: tuple[int, int]) -> Preprocess:
    """timm's pretrained_cfg as a Preprocess; timm's ViT defaults (0.9 centre crop, bicubic) without one."""
    pc: dict[str, Any] = dict((sidecar or {}).get("pretrained_cfg") or {})
    size = pc.get("input_size", [3, *image_size])
    return Preprocess(
        image_size=(int(size[1]), int(size[2])),
        mean=tuple(pc.get("mean", INCEPTION_MEAN)),
        std=tuple(pc.get("std", INCEPTION_STD)),
        resize="squash" if pc.get("crop_mode") == "squash" else "crop",
        crop_pct=float(pc.get("crop_pct", 0.9)),
        interpolation=str(pc.get("interpolation", "bicubic")),
    )


def load(
    path: Path,
    *,
    num_heads: int | None = None,
    gelu: str | None = None,
    layer_norm_eps: float | None = None,
    image_size: tuple[int, int] | None = None,
) -> Checkpoint:
    """Read a timm ViT state dict (file or hub folder) into vitkit's layout, shape-checked.

    ``num_heads``, ``gelu`` ("exact"/"tanh"), ``layer_norm_eps`` and ``image_size`` (the resolution the
    weights were trained at) override what the file cannot tell.
    """
    weights_path = _weights_path(path)
    if weights_path is None:
        raise CheckpointError(f"{path}: expected a {'/'.join(SUFFIXES)} file or a timm folder with model weights")
    weights = torch_files.read_state_file(weights_path)
    sidecar = _sidecar(path)
    cfg, no_embed_class = infer_config(
        weights,
        sidecar,
        str(path),
        num_heads=num_heads,
        gelu=gelu,
        layer_norm_eps=layer_norm_eps,
        image_size=image_size,
    )
    check_fits_file(cfg, sum(v.numel() for v in weights.values()), str(path))
    arrays = {k: torch_files.to_numpy(v) for k, v in weights.items()}
    state = to_state_dict(key_map(cfg, no_embed_class=no_embed_class), arrays, expected_state(cfg), source=str(path))
    labels = (sidecar or {}).get("label_names")
    provenance: dict[str, Any] = {"layout": "timm VisionTransformer", "no_embed_class": no_embed_class}
    if sidecar:
        provenance["architecture"] = sidecar.get("architecture")
    if not (num_heads or ((sidecar or {}).get("model_args") or {}).get("num_heads")):
        provenance["num_heads"] = f"{cfg.num_heads} (inferred from the width; pass num_heads= if different)"
    meta = CheckpointMeta(
        format=FORMAT,
        source=str(path),
        preprocess=preprocess_from(sidecar, cfg.image_size),
        class_names=list(labels) if isinstance(labels, list) and len(labels) == cfg.num_classes else None,
        provenance=provenance,
    )
    return Checkpoint(cfg, state, meta)


def timm_config(cfg: ViTConfig, meta: CheckpointMeta | None) -> dict[str, Any]:
    """A timm hub ``config.json``: the architecture plus the model_args that rebuild exactly this model."""
    pre = meta.preprocess if meta else Preprocess(image_size=cfg.image_size)
    pool = "token" if cfg.classifier == "token" else "avg"
    doc: dict[str, Any] = {
        "architecture": "vit_base_patch16_224",  # any ViT entry point; model_args override every field
        "num_classes": cfg.num_classes,
        "num_features": cfg.hidden_size,
        "global_pool": pool,
        "model_args": {
            "img_size": list(cfg.image_size),
            "patch_size": cfg.patch_size,
            "in_chans": cfg.in_channels,
            "embed_dim": cfg.hidden_size,
            "depth": cfg.depth,
            "num_heads": cfg.num_heads,
            "mlp_ratio": cfg.mlp_dim / cfg.hidden_size,
            "qkv_bias": cfg.qkv_bias,
            "class_token": cfg.classifier == "token",
            "global_pool": pool,
            "fc_norm": False,
            "num_classes": cfg.num_classes,
            **({"act_layer": "gelu_tanh"} if cfg.gelu == "tanh" else {}),
        },
        "pretrained_cfg": {
            "input_size": [cfg.in_channels, *pre.image_size],
            "interpolation": pre.interpolation,
            "mean": list(pre.mean),
            "std": list(pre.std),
            "crop_pct": pre.crop_pct if pre.resize == "crop" else 1.0,
            "crop_mode": "center" if pre.resize == "crop" else "squash",
            "num_classes": cfg.num_classes,
        },
    }
    if meta and meta.class_names:
        doc["label_names"] = list(meta.class_names)
    if cfg.layer_norm_eps != 1e-6:  # timm builds eps 1e-6; kept here so vitkit reads back the exact model
        doc["layer_norm_eps"] = cfg.layer_norm_eps
    return doc


def _recoverable_from_shapes(cfg: ViTConfig) -> bool:
    """Whether a bare state dict (no config) reads back as exactly this model."""
    heads = HEADS_BY_WIDTH.get(cfg.hidden_size) or max(cfg.hidden_size // 64, 1)
    square = cfg.grid_size[0] == cfg.grid_size[1]
    return cfg.num_heads == heads and cfg.gelu == "exact" and cfg.layer_norm_eps == 1e-6 and square


def check_output(out: Path, overwrite: bool) -> None:
    """May :func:`save` write ``out``: a ``.safetensors``/``.pth`` file (an existing one only with ``overwrite``), or
    else a folder (only a checkpoint folder vitkit wrote, and that only with ``overwrite``)."""
    if out.suffix in SUFFIXES:
        check_output_file(out, overwrite=overwrite)
    else:
        torch_files.check_folder_output(out, overwrite)


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write a timm state dict: ``.safetensors``/``.pth`` file, or a hub folder (with config.json) otherwise.

    Files are written atomically; an existing file or vitkit-written folder is replaced only with ``overwrite``.
    """
    out = Path(path)
    check_output(out, overwrite)
    cfg = model.cfg
    target = "a timm state dict"
    require(cfg.resnet_layers is None, target, "hybrid stems use timm's ResNetV2 with different StdConv eps")
    require(not cfg.representation_size, target, "current timm ViTs have no pre-logits layer")
    cfg, state = with_learned_posemb(cfg, export_state(model))
    arrays = from_state_dict(key_map(cfg), state)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        metadata = {"format": "pt", META_KEY: json.dumps(timm_config(cfg, meta)), WRITER_KEY: WRITER}
        return write_file_atomic(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    if out.suffix in torch_files.PICKLE_SUFFIXES:
        require(
            _recoverable_from_shapes(cfg),
            f"{out.name}",
            f"a bare .pth cannot record heads={cfg.num_heads}, gelu={cfg.gelu}, eps={cfg.layer_norm_eps} or a "
            "non-square grid; write a .safetensors file or a folder (both carry timm's config)",
        )
        return write_file_atomic(out, lambda tmp: torch.save(tensors, tmp))
    files = {"config.json": json.dumps(timm_config(cfg, meta), indent=2) + "\n"}
    return torch_files.write_folder(out, tensors, files, overwrite=overwrite)
