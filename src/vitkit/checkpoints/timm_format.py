"""timm ``VisionTransformer`` state dicts: a ``.safetensors`` or ``.pth`` file, or a timm hub folder.

Names (timm's fused-qkv layout, nearly vitkit's own)::

    patch_embed.proj.{weight,[bias]}  cls_token (1, 1, D)  dist_token  reg_token (1, R, D)  pos_embed  norm_pre
    blocks.{i}.norm1, attn.qkv (3D, D), attn.proj, ls1.gamma, norm2, mlp.fc1 (or fc1_g, fc1_x), mlp.fc2, ls2.gamma
    norm    attn_pool.{latent, q, kv, proj, norm, mlp.fc1, mlp.fc2}    head    head_dist    pre_logits.fc

Semantics, from timm's ``vision_transformer.py`` and ``deit.py``; what the weights show is read from them
(register count, layer scale, pre-norm, patch bias, MAP head, distillation token, plain/SwiGLU MLP), the rest
from ``model_args`` and checked against the weights:

- ``pos_embed`` with slots for the class (and DeiT's distillation) token is added after they are prepended
  (vitkit's layout); with ``N`` entries (``no_embed_class=True``: DeiT-3, DINOv2, big_vision ports) it is added
  to the patches only, which vitkit represents exactly with zero slots. Registers (timm ``reg_tokens``) follow
  the class token without position (DINOv2); registers *with* position slots (``no_embed_class=False``) are
  refused. On export a model with registers is written ``no_embed_class``, its class slot added to the token.
- global_pool "token" reads the class token after ``norm`` (DeiT distilled: the mean of the class and
  distillation tokens, logits the mean of ``head`` and ``head_dist``); "avg" with ``fc_norm=False`` is vitkit's
  "gap"; "map" is timm's ``AttentionPoolLatent`` (SigLIP), vitkit's MAP head (one latent; beside prefix tokens
  only with ``pool_include_prefix``). ``fc_norm`` (LN of the pooled vector, a different function), qk-norm,
  ``scale_attn_norm``/``scale_mlp_norm`` and hybrid (ResNet) stems are refused.
- The activation is ``act_layer``: ``gelu`` (timm's default), ``gelu_tanh``, ``quick_gelu`` (CLIP), ``silu``
  (the gate of ``SwiGLUPacked``'s fc1 = [gate; up], vitkit's own layout, or ``SwiGLU``'s fc1_g/fc1_x; required
  for a gated MLP). timm's SigLIP and CLIP entry points differ in it, so for MAP or pre-norm weights a config
  without ``act_layer`` is refused (pass ``gelu=``). LayerNorm eps is 1e-6 unless the config's
  ``layer_norm_eps`` says (pre-norm CLIP towers set 1e-5 in code: required, or ``layer_norm_eps=``).
- timm's CLIP image towers hold the projection as a bias-free ``head``: it loads as the head; vitkit's
  ``projection_size`` is written back as ``head`` with a zero bias.
- The number of heads does not show in any shape: it comes from the sidecar config (``model_args.num_heads``)
  or the paper's widths (Ti 3, S 6, B 12, L 16, H 16; otherwise width / 64), or ``num_heads=`` in :func:`load`.
  Layer scale's value in the config is only its initialisation (``init_values``, else 1e-5).

A timm hub folder is ``config.json`` (``architecture``, ``model_args``, ``pretrained_cfg``, ``label_names``)
plus ``model.safetensors``; for a single file, a ``config.json`` with an ``architecture`` key beside it is used.
``.safetensors`` files written by vitkit carry that config in their metadata (timm ignores it), so heads,
GELU kind, LayerNorm eps, image size and labels survive; a bare ``.pth`` is written only when the shapes and
timm's defaults determine the model. This module reads; :mod:`vitkit.checkpoints.timm_writer` writes.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import torch_files
from vitkit.checkpoints.keymap import Array, Rule, expand, rule, stacked, weight_bias
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, convert, is_square, refusing
from vitkit.checkpoints.preprocess import INCEPTION_MEAN, INCEPTION_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import ViTConfig

FORMAT = "timm"
SUFFIXES = (".safetensors", *torch_files.PICKLE_SUFFIXES)
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
UNSUPPORTED = {
    "fc_norm.": "fc_norm (LayerNorm on the pooled vector, timm global_pool='avg')",
    ".attn.q_norm.": "qk-norm",
    ".attn.norm.": "scale_attn_norm",
    ".mlp.norm.": "scale_mlp_norm",
    "attn_pool.q_norm.": "qk-norm in the attention pool",
    "attn_pool.pos_embed": "a position embedding in the attention pool",
    "patch_embed.backbone.": "hybrid ResNet stem (load the official .npz instead)",
}
# timm's act_layer names -> vitkit's activation ("silu": the SwiGLU MLP's gate)
ACT_LAYERS = {"gelu": "exact", "gelu_tanh": "tanh", "gelu_new": "tanh", "quick_gelu": "quick", "silu": "silu"}
ACT_NAMES = {"exact": "gelu", "tanh": "gelu_tanh", "quick": "quick_gelu"}
_LINEARS = ["norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc2"]
_POOL_PARTS = ["q", "kv", "proj", "norm", "mlp.fc1", "mlp.fc2"]


def _mlp_rules(cfg: ViTConfig, split_swiglu: bool) -> list[Rule]:
    """fc1: plain, timm's SwiGLUPacked (one fc1, gate rows first: vitkit's own layout) or SwiGLU (fc1_g, fc1_x)."""
    if cfg.mlp == "swiglu" and split_swiglu:
        fc1 = "blocks.{i}.mlp.fc1"
        return [stacked(f"{fc1}.{p}", [f"{fc1}_{n}.{p}" for n in "gx"]) for p in ("weight", "bias")]
    return weight_bias("blocks.{i}.mlp.fc1", "blocks.{i}.mlp.fc1")


def key_map(cfg: ViTConfig, *, no_embed_class: bool = False, split_swiglu: bool = False) -> list[Rule]:
    """timm names for a model with this config (blocks expanded). ``no_embed_class``: timm's pos_embed covers the
    patches only (vitkit's class/distillation slots are zero); ``split_swiglu``: SwiGLU's fc1_g/fc1_x."""
    rules = weight_bias("patch_embed.proj", "patch_embed.proj", cfg.patch_bias)
    for name in _LINEARS:
        rules += weight_bias(f"blocks.{{i}}.{name}", f"blocks.{{i}}.{name}", name != "attn.qkv" or cfg.qkv_bias)
    rules += _mlp_rules(cfg, split_swiglu) + weight_bias("norm", "norm")
    if cfg.layer_scale is not None:
        rules += [rule(f"blocks.{{i}}.ls{n}.gamma", f"blocks.{{i}}.ls{n}.gamma") for n in (1, 2)]
    if cfg.norm_pre:
        rules += weight_bias("norm_pre", "norm_pre")
    rules += [rule(t, t) for t in ("cls_token", "dist_token", "reg_token") if _has_token(cfg, t)]
    if cfg.pos_embed == "learned":
        slots = cfg.num_pos_prefix
        if no_embed_class and slots:
            rules.append(rule("pos_embed", "pos_embed", _with_zero_slots(slots), _without_slots(slots)))
        else:
            rules.append(rule("pos_embed", "pos_embed"))
    if cfg.classifier == "map":
        rules.append(rule("attn_pool.probe", "attn_pool.latent"))
        for part in _POOL_PARTS:
            rules += weight_bias(f"attn_pool.{part}", f"attn_pool.{part}")
    if cfg.representation_size:
        rules += [rule(f"pre_logits.0.{p}", f"pre_logits.fc.{p}") for p in ("weight", "bias")]
    if cfg.projection_size and cfg.num_classes == 0:  # timm's CLIP towers: the projection is a bias-free head
        rules.append(rule("projection.weight", ["head.weight", "head.bias"], _bias_free, _zero_bias))
    for head in ("head", "head_dist") if cfg.num_classes > 0 else ():
        if head == "head" or cfg.distilled:
            rules += weight_bias(head, head)
    return expand(rules, cfg.depth)


def _bias_free(w: Array, b: Array) -> Array:
    if np.any(b):
        raise ValueError("a projection has no bias, but head.bias is not zero")
    return w


def _zero_bias(w: Array) -> tuple[Array, Array]:
    return w, np.zeros(w.shape[0], dtype=w.dtype)


def _has_token(cfg: ViTConfig, name: str) -> bool:
    return {"cls_token": bool(cfg.class_token), "dist_token": cfg.distilled, "reg_token": cfg.num_registers > 0}[name]


def _with_zero_slots(n: int) -> Callable[[Array], Array]:
    return lambda pe: np.concatenate([np.zeros_like(pe[:, :1]).repeat(n, axis=1), pe], axis=1)


def _without_slots(n: int) -> Callable[[Array], tuple[Array]]:
    return lambda pe: (pe[:, n:],)


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


def timm_keys(path: Path) -> set[str] | None:
    """The state-dict keys of a timm file or folder (read from the header where the format has one), or None when
    ``path`` is neither (a folder is timm's only with its config.json: HF and vitkit folders have their own)."""
    if path.is_dir() and _sidecar(path) is None:
        return None
    weights = _weights_path(path)
    return (torch_files.readable_keys(weights) or None) if weights is not None else None


def looks_like(path: Path) -> bool:
    """A timm state dict: keys ``patch_embed.proj.weight`` and ``blocks.0.attn.qkv.weight``."""
    keys = timm_keys(path) or set()
    return "patch_embed.proj.weight" in keys and "blocks.0.attn.qkv.weight" in keys


@dataclass(frozen=True)
class Layout:
    """How a timm state dict stores what vitkit's config leaves open: ``no_embed_class`` (pos_embed on the
    patches only) and ``split_swiglu`` (timm's SwiGLU with fc1_g/fc1_x rather than SwiGLUPacked's one fc1)."""

    no_embed_class: bool = False
    split_swiglu: bool = False


def infer_config(
    weights: Mapping[str, torch.Tensor],
    sidecar: Mapping[str, Any] | None,
    source: str,
    *,
    num_heads: int | None = None,
    gelu: str | None = None,
    layer_norm_eps: float | None = None,
    image_size: tuple[int, int] | None = None,
) -> tuple[ViTConfig, Layout]:
    """(config, layout) from shapes, the optional sidecar config and explicit overrides."""
    for marker, what in UNSUPPORTED.items():
        if any(marker in k or k.startswith(marker) for k in weights):
            raise CheckpointError(f"{source}: timm {what} is not supported by vitkit's ViT")
    doc = dict(sidecar or {})
    args: dict[str, Any] = dict(doc.get("model_args") or {})
    if "patch_embed.proj.weight" not in weights:
        raise CheckpointError(f"{source}: not a complete timm ViT state dict, missing patch_embed.proj.weight")
    D, C, P, P2 = (int(n) for n in weights["patch_embed.proj.weight"].shape)
    if P != P2:
        raise CheckpointError(f"{source}: non-square patches {P}x{P2} are not supported")
    tokens = _tokens(weights, args, D, source)
    classifier = _classifier(weights, args, doc.get("global_pool"), tokens, source)
    mlp, mlp_dim, split = _mlp(weights, source)
    norm_pre = _agree(args, "pre_norm", "norm_pre.weight" in weights, "norm_pre", source)
    scaled = _agree(args, "init_values", "blocks.0.ls1.gamma" in weights, "layer scale (ls1.gamma)", source)
    family = "attention pooling (global_pool='map')" if classifier == "map" else "pre-norm (CLIP)" if norm_pre else ""
    act = _activation(args.get("act_layer"), mlp, gelu, family, source)
    eps = layer_norm_eps if layer_norm_eps is not None else doc.get("layer_norm_eps")
    if eps is None and norm_pre:
        raise CheckpointError(
            f"{source}: pre-norm (CLIP) checkpoints set their LayerNorm eps in code (timm's CLIP towers: 1e-5) and "
            "config.json has no layer_norm_eps; pass layer_norm_eps="
        )
    depth = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    heads = num_heads or args.get("num_heads") or HEADS_BY_WIDTH.get(D) or max(D // 64, 1)
    if "pos_embed" not in weights:
        raise CheckpointError(f"{source}: no pos_embed (models without position embedding are not supported)")
    n = int(weights["pos_embed"].shape[1])
    size = image_size or args.get("img_size") or (doc.get("pretrained_cfg") or {}).get("input_size", [])[1:]
    slots = int(tokens["class_token"]) + int(tokens["distilled"])
    image, no_embed_class = _grid_layout(n, slots, P, size, args.get("no_embed_class"), source)
    with refusing(source):
        cfg = ViTConfig(
            image_size=image,
            patch_size=P,
            in_channels=C,
            num_classes=int(weights["head.weight"].shape[0]) if "head.weight" in weights else 0,
            hidden_size=D,
            depth=depth,
            num_heads=int(heads),
            mlp_dim=mlp_dim,
            classifier=classifier,  # type: ignore[arg-type]
            representation_size=int(weights["pre_logits.fc.weight"].shape[0])
            if "pre_logits.fc.weight" in weights
            else None,
            gelu=act,  # type: ignore[arg-type]
            layer_norm_eps=1e-6 if eps is None else eps,
            qkv_bias="blocks.0.attn.qkv.bias" in weights,
            layer_scale=float(args.get("init_values") or 1e-5) if scaled else None,  # only its initial value
            mlp=mlp,  # type: ignore[arg-type]
            norm_pre=norm_pre,
            patch_bias="patch_embed.proj.bias" in weights,
            **tokens,
        )
    return cfg, Layout(no_embed_class, split)


def _agree(args: Mapping[str, Any], key: str, present: bool, what: str, source: str) -> bool:
    """``present`` (seen in the weights), checked against model_args[key] when the config says."""
    if args.get(key) is not None and bool(args[key]) != present:
        raise CheckpointError(
            f"{source}: model_args.{key}={args[key]!r}, but the weights {'have' if present else 'have no'} {what}"
        )
    return present


def _tokens(weights: Mapping[str, torch.Tensor], args: Mapping[str, Any], D: int, source: str) -> dict[str, Any]:
    """class_token, distilled (DeiT's dist_token) and num_registers (reg_token (1, R, D)), checked against the
    config."""
    token = _agree(args, "class_token", "cls_token" in weights, "a class token (cls_token)", source)
    distilled = "dist_token" in weights
    regs = 0
    if "reg_token" in weights:
        shape = tuple(int(n) for n in weights["reg_token"].shape)
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != D:
            raise CheckpointError(f"{source}: reg_token has shape {shape}, expected (1, registers, {D})")
        regs = shape[1]
    if args.get("reg_tokens") is not None and args["reg_tokens"] != regs:
        raise CheckpointError(
            f"{source}: model_args.reg_tokens={args['reg_tokens']!r}, but the weights hold {regs} register tokens"
        )
    if regs and args.get("no_embed_class") is False:
        raise CheckpointError(
            f"{source}: timm register tokens with position slots (no_embed_class=False) are not supported"
        )
    if distilled and (regs or not token):
        raise CheckpointError(f"{source}: a distillation token needs a class token and no registers (timm's DeiT)")
    return {"class_token": token, "distilled": distilled, "num_registers": regs}


def _classifier(
    weights: Mapping[str, torch.Tensor], args: Mapping[str, Any], top_pool: Any, tokens: Mapping[str, Any], source: str
) -> str:
    """vitkit's pooling from timm's global_pool and the weights: token, avg (without fc_norm: "gap") or map."""
    pool = args.get("global_pool", top_pool)
    prefix = int(tokens["class_token"]) + int(tokens["distilled"]) + tokens["num_registers"]
    if "attn_pool.latent" in weights:
        latent = tuple(weights["attn_pool.latent"].shape)
        if pool not in (None, "map") or len(latent) != 3 or latent[:2] != (1, 1):
            raise CheckpointError(f"{source}: attn_pool with global_pool={pool!r} and latent {latent} is not supported")
        if prefix and not args.get("pool_include_prefix"):
            raise CheckpointError(
                f"{source}: timm attention pooling over the patches only (pool_include_prefix=False) beside prefix "
                "tokens is not supported"
            )
        return "map"
    if pool in (None, "token") and tokens["class_token"]:
        return "token"
    if tokens["distilled"]:
        raise CheckpointError(f"{source}: global_pool={pool!r} with a distillation token (timm's DeiT reads 'token')")
    if pool in (None, "avg") and not (prefix and args.get("pool_include_prefix")):
        return "gap"
    raise CheckpointError(f"{source}: global_pool={pool!r} is not supported (token, avg or map)")


def _mlp(weights: Mapping[str, torch.Tensor], source: str) -> tuple[str, int, bool]:
    """(kind, hidden width, split SwiGLU) from block 0's MLP shapes."""
    if "blocks.0.mlp.fc1_g.weight" in weights:
        return "swiglu", int(weights["blocks.0.mlp.fc1_g.weight"].shape[0]), True
    try:
        h1, h2 = int(weights["blocks.0.mlp.fc1.weight"].shape[0]), int(weights["blocks.0.mlp.fc2.weight"].shape[1])
    except (KeyError, IndexError) as e:
        raise CheckpointError(f"{source}: not a complete timm ViT state dict, missing {e.args[0]}") from None
    if h1 == h2:
        return "plain", h1, False
    if h1 == 2 * h2:
        return "swiglu", h2, False  # timm's SwiGLUPacked: fc1 = [gate; up], vitkit's own layout
    raise CheckpointError(f"{source}: mlp.fc1 has {h1} outputs and mlp.fc2 {h2} inputs (neither an MLP nor SwiGLU)")


def _activation(act: Any, mlp: str, gelu: str | None, family: str, source: str) -> str:
    """vitkit's gelu from timm's act_layer: read, never assumed where timm's entry points for a family differ."""
    if act is not None and (not isinstance(act, str) or act not in ACT_LAYERS):
        raise CheckpointError(f"{source}: act_layer {act!r} is not supported (known: {', '.join(ACT_LAYERS)})")
    kind = ACT_LAYERS.get(act) if act is not None else None
    if mlp == "swiglu":
        if kind != "silu":
            raise CheckpointError(
                f"{source}: a SwiGLU MLP needs act_layer 'silu' in model_args (got {act!r}); the weights do not show it"
            )
        return "exact"  # unused: the gate is SiLU
    if kind == "silu":
        raise CheckpointError(f"{source}: act_layer 'silu' with a plain MLP is not supported")
    if gelu or kind:
        return str(gelu or kind)
    if family:
        raise CheckpointError(
            f"{source}: timm's {family} models differ in act_layer and config.json has no model_args.act_layer; "
            "pass gelu="
        )
    return "exact"


def _grid_layout(
    n: int, slots: int, patch: int, size: Any, no_embed_class: Any, source: str
) -> tuple[tuple[int, int], bool]:
    """(image size, no_embed_class) for a ``pos_embed`` of ``n`` entries, ``slots`` of them possibly for the
    class (and distillation) token.

    With an image size (timm's config: ``model_args.img_size`` or ``pretrained_cfg.input_size``; or given),
    the grid is known and the entry count says whether the prefix tokens have slots. Without one, only a
    square grid can be assumed, and ``n`` entries with a class token are ambiguous when ``n`` is a square:
    a sqrt(n) x sqrt(n) grid with no class slot (timm ``no_embed_class``), or a class slot plus a non-square
    grid of n - 1 (a 32x48 image with 8 px patches: 1 + 24 = 25) -- refused rather than guessed.
    """
    what = "a class slot" if slots == 1 else "class and distillation slots"
    if isinstance(size, int) or (isinstance(size, (list, tuple)) and len(size) == 2):
        image = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if image[0] % patch or image[1] % patch:
            raise CheckpointError(f"{source}: image size {image} is not a multiple of the patch size {patch}")
        grid = (image[0] // patch) * (image[1] // patch)
        if not slots and n == grid:
            return image, False
        if slots and n in (grid, grid + slots) and (no_embed_class is None or bool(no_embed_class) == (n == grid)):
            return image, n == grid
        raise CheckpointError(
            f"{source}: pos_embed has {n} entries, but the image size {image} with {patch} px patches gives "
            f"{grid} grid tokens{f' (plus {what} unless no_embed_class)' if slots else ''}"
        )
    if slots and no_embed_class is None and is_square(n) and n > 1:
        raise CheckpointError(
            f"{source}: {n} position entries are either a {math.isqrt(n)}x{math.isqrt(n)} grid with no class slot "
            f"(timm no_embed_class) or {what} plus a non-square grid of {n - slots}; put timm's config.json "
            "(model_args.img_size) beside the weights, or pass image_size to timm_format.load"
        )
    nec = bool(no_embed_class) if slots and no_embed_class is not None else False
    grid_tokens = n - (slots if not nec else 0)
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
    crop_pct = float(pc.get("crop_pct", 0.9))
    squash = pc.get("crop_mode") == "squash"  # timm's squash: each side to size / crop_pct, then the centre crop
    return Preprocess(
        image_size=(int(size[1]), int(size[2])),
        mean=tuple(pc.get("mean", INCEPTION_MEAN)),
        std=tuple(pc.get("std", INCEPTION_STD)),
        resize=("squash" if crop_pct == 1.0 else "squash_crop") if squash else "crop",
        crop_pct=crop_pct,
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

    ``num_heads``, ``gelu`` ("exact"/"tanh"/"quick"), ``layer_norm_eps`` and ``image_size`` (the resolution the
    weights were trained at) override what the file cannot tell.
    """
    weights = read_weights(path, "/".join(SUFFIXES))
    sidecar = _sidecar(path)
    cfg, layout = infer_config(
        weights,
        sidecar,
        str(path),
        num_heads=num_heads,
        gelu=gelu,
        layer_norm_eps=layer_norm_eps,
        image_size=image_size,
    )
    rules = lambda c: key_map(c, no_embed_class=layout.no_embed_class, split_swiglu=layout.split_swiglu)  # noqa: E731
    state = convert(cfg, weights, str(path), rules)
    provenance: dict[str, Any] = {"layout": "timm VisionTransformer", "no_embed_class": layout.no_embed_class}
    if sidecar:
        provenance["architecture"] = sidecar.get("architecture")
    if not (num_heads or ((sidecar or {}).get("model_args") or {}).get("num_heads")):
        provenance["num_heads"] = f"{cfg.num_heads} (inferred from the width; pass num_heads= if different)"
    return checkpoint(path, cfg, state, sidecar, provenance, preprocess_from(sidecar, cfg.image_size))


def read_weights(path: Path, files: str) -> dict[str, torch.Tensor]:
    """The state dict of a timm file or hub folder; CheckpointError naming the ``files`` expected if there is none."""
    weights_path = _weights_path(path)
    if weights_path is None:
        raise CheckpointError(f"{path}: expected a {files} file or a timm folder with model weights")
    return torch_files.read_state_file(weights_path)


def checkpoint(
    path: Path,
    cfg: ViTConfig,
    state: dict[str, torch.Tensor],
    doc: Mapping[str, Any] | None,
    provenance: dict[str, Any],
    preprocess: Preprocess,
    format: str = FORMAT,
) -> Checkpoint:
    """A timm reader's checkpoint, with the label names of timm's config ``doc`` when there is one per class."""
    labels = (doc or {}).get("label_names")
    names = list(labels) if isinstance(labels, list) and len(labels) == cfg.num_classes else None
    return Checkpoint(cfg, state, CheckpointMeta(format, str(path), preprocess, names, provenance))
