"""timm's ``Eva`` state dicts (``timm/models/eva.py``) of its DINOv3 models (``vit_{tiny,small,small_plus,base,
large,huge_plus,7b}_patch16_dinov3[_qkvb]``): a ``.safetensors``/``.pth`` file with timm's ``config.json`` beside it,
or a timm hub folder. Read and written.

Names (timm's Eva, beside vitkit's own timm-style names)::

    cls_token (1, 1, D)  reg_token (1, R, D)  patch_embed.proj.{weight,bias}   (no pos_embed: RoPE only)
    blocks.{i}.norm1, attn.qkv (3D, D) [+ attn.q_bias, attn.v_bias: "_qkvb", no key bias], attn.proj,
    gamma_1 (layer scale), norm2, mlp.fc1 (or SwiGLU's mlp.fc1_g, mlp.fc1_x), mlp.fc2, gamma_2
    norm    head

Semantics, from timm's ``Eva``, ``EvaBlock`` and ``RotaryEmbeddingDinoV3``: pre-norm blocks with layer scale
(``gamma_1``/``gamma_2``), DINOv3's RoPE on the patch tokens (``rope_type='dinov3'``, ``rope_temperature`` 100 in
every entry point, vitkit's ``rope="dinov3"``/``rope_theta``) with the class token and ``num_reg_tokens`` registers
before the patches, LayerNorm eps 1e-5, exact GELU or SwiGLU (``swiglu_mlp``: ``act(fc1_g(x)) * fc1_x(x)``,
vitkit's ``fc1 = [gate; up]``). ``global_pool`` "token" is the class token after ``norm``; "avg" (timm's default for
these entry points) the mean of the patch tokens after ``norm`` (vitkit's "gap"). The weights show the registers,
the layer scale, the biases and the MLP; the number of heads shows in no shape: it comes from ``model_args`` or the
entry points' widths (192: 3, 384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32). The RoPE settings are in no weight
either, so a file without timm's config (an ``architecture`` that is a DINOv3 entry point, or ``model_args`` with
``rope_type='dinov3'``) is refused. EVA-02 (``rope_type='cat'``) is read and written by
:mod:`vitkit.checkpoints.timm_eva02`, whose :func:`~vitkit.checkpoints.timm_eva02.load` hands the DINOv3 models here.
A DINOv3 config with what its models do not have -- a learned position embedding beside RoPE, a LayerNorm inside
the MLP or the attention, qk-norm, ``fc_norm`` -- and the RoPE-ViT models' ``'mixed'`` RoPE are refused in one line
naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints import timm_format, timm_writer, torch_files
from vitkit.checkpoints.keymap import Rule, expand, from_state_dict, rule, weight_bias
from vitkit.checkpoints.loaded import (
    Checkpoint,
    CheckpointMeta,
    convert,
    export_state,
    refusing,
    require,
    require_unseen,
)
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.vit import VisionTransformer, ViTConfig

FORMAT = "timm_eva"
ENTRY = re.compile(r"^vit_(tiny|small|small_plus|base|large|huge_plus|7b)_patch16_dinov3(_qkvb)?$")
SIZES = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1280: "huge_plus", 4096: "7b"}
# each entry point's width and depth (timm 1.0.31 eva.py); all have 4 registers
SHAPES = {"tiny": (192, 12), "small": (384, 12), "small_plus": (384, 12), "base": (768, 12), "large": (1024, 24),
          "huge_plus": (1280, 32), "7b": (4096, 40)}  # fmt: skip
HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32}
ROPE_TEMPERATURE = 100.0  # every DINOv3 entry point's
EPS = 1e-5  # every DINOv3 entry point's norm_layer
# keys only timm's Eva has: layer scale as gamma_1, q/v biases beside a fused qkv, EVA-02's own names (timm's
# VisionTransformer: ls1.gamma, attn.qkv.bias, no norm inside the MLP)
MARKERS = ("blocks.0.gamma_1", "blocks.0.attn.q_bias", "blocks.0.attn.q_proj.weight", "blocks.0.mlp.ffn_ln.weight",
           "blocks.0.mlp.norm.weight")  # fmt: skip
# what timm's Eva holds that vitkit's ViT does not compute (key -> what it is)
REFUSED = {
    "pos_embed": "a learned position embedding beside RoPE (EVA-02, RoPE-ViT 'ape')",
    "blocks.0.mlp.norm.weight": "a LayerNorm inside the MLP (EVA-02's scale_mlp, sub-LN)",
    "blocks.0.mlp.ffn_ln.weight": "a LayerNorm inside the MLP (EVA-02's scale_mlp, sub-LN)",
    "blocks.0.attn.norm.weight": "a LayerNorm inside the attention (scale_attn_inner)",
    "blocks.0.attn.q_norm.weight": "qk-norm",
    "blocks.0.attn.q_proj.weight": "separate q/k/v projections (qkv_fused=False, EVA-02)",
    "fc_norm.weight": "fc_norm (a LayerNorm of the pooled vector)",
    "norm_pre.weight": "a LayerNorm before the blocks (norm_pre)",
}


def looks_like(path: Path) -> bool:
    """A timm Eva state dict (file or timm folder): Eva's keys, or timm's config naming an Eva architecture."""
    keys = timm_format.timm_keys(path)
    if keys is None or "patch_embed.proj.weight" not in keys:
        return False
    if any(m in keys for m in MARKERS):
        return True  # the config is read only when the keys do not tell
    arch = str((timm_format._sidecar(path) or {}).get("architecture", ""))
    return bool(ENTRY.match(arch)) or arch.startswith("eva")


def key_map(cfg: ViTConfig, split_swiglu: bool = True) -> list[Rule]:
    """timm Eva names for a DINOv3 model with this config (blocks expanded); ``split_swiglu``: SwiGLU as
    ``fc1_g``/``fc1_x`` (timm's SwiGLU, with ``swiglu_align_to``), else one packed ``fc1`` (GluMlp)."""
    rules = weight_bias("patch_embed.proj", "patch_embed.proj", cfg.patch_bias)
    for name in ("norm1", "attn.proj", "norm2", "mlp.fc2"):
        rules += weight_bias(f"blocks.{{i}}.{name}", f"blocks.{{i}}.{name}")
    rules.append(rule("blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.qkv.weight"))
    if cfg.qkv_bias and cfg.key_bias:
        rules.append(rule("blocks.{i}.attn.qkv.bias", "blocks.{i}.attn.qkv.bias"))
    elif cfg.qkv_bias:
        rules += [rule(f"blocks.{{i}}.attn.{b}_bias", f"blocks.{{i}}.attn.{b}_bias") for b in "qv"]
    rules += timm_format._mlp_rules(cfg, split_swiglu) + weight_bias("norm", "norm")
    if cfg.layer_scale is not None:
        rules += [rule(f"blocks.{{i}}.ls{n}.gamma", f"blocks.{{i}}.gamma_{n}") for n in (1, 2)]
    rules += [rule(t, t) for t in ("cls_token", "reg_token") if timm_format._has_token(cfg, t)]
    if cfg.num_classes > 0:
        rules += weight_bias("head", "head")
    return expand(rules, cfg.depth)


def _architecture(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The model_args that rebuild the model: the entry point's, then the config's own."""
    arch = str(doc.get("architecture", ""))
    args = dict(doc.get("model_args") or {})
    entry = ENTRY.match(arch)
    if entry:
        D, depth = SHAPES[entry.group(1)]
        base = {"rope_type": "dinov3", "rope_temperature": ROPE_TEMPERATURE, "rope_rotate_half": True,
                "embed_dim": D, "depth": depth, "num_reg_tokens": 4}  # fmt: skip
        return {**base, "qkv_bias": arch.endswith("_qkvb"), **args}
    if args.get("rope_type") == "dinov3":
        return args
    kind = args.get("rope_type") or "EVA's default 'cat'"
    raise CheckpointError(
        f"{source}: timm Eva architecture {arch or '(none)'!r} with RoPE {kind} is not supported (vitkit computes "
        "DINOv3's RoPE, model_args.rope_type 'dinov3', and EVA-02's, 'cat' with an eva* architecture)"
    )


def infer_config(
    weights: Mapping[str, torch.Tensor], sidecar: Mapping[str, Any] | None, source: str
) -> tuple[ViTConfig, dict[str, Any], bool]:
    """(config, the model_args used, SwiGLU split into fc1_g/fc1_x) from the weights' shapes and timm's config,
    every option checked."""
    for key, what in REFUSED.items():
        if key in weights:
            raise CheckpointError(f"{source}: timm Eva with {what} ({key}) is not supported by vitkit's ViT")
    if sidecar is None:
        raise CheckpointError(
            f"{source}: a timm Eva state dict without timm's config.json (architecture, model_args): its RoPE settings "
            "are in no weight; put the hub's config.json beside it"
        )
    args = _architecture(sidecar, source)
    for key, want in (("rope_rotate_half", True), ("use_fc_norm", False), ("use_abs_pos_emb", False)):
        if key in args and bool(args[key]) != want:
            raise CheckpointError(f"{source}: model_args.{key}={args[key]!r} is not supported (DINOv3: {want})")
    D, C, P, P2 = (int(n) for n in weights["patch_embed.proj.weight"].shape)
    if P != P2:
        raise CheckpointError(f"{source}: non-square patches {P}x{P2} are not supported")
    regs = tuple(int(n) for n in weights["reg_token"].shape) if "reg_token" in weights else (1, 0, D)
    depth = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    for key, found in (("embed_dim", D), ("depth", depth), ("num_reg_tokens", regs[1])):
        if key in args and int(args[key]) != found:
            raise CheckpointError(f"{source}: {sidecar.get('architecture')} has {key} {args[key]}, the weights {found}")
    if len(regs) != 3 or regs[0] != 1 or regs[2] != D:
        raise CheckpointError(f"{source}: reg_token has shape {regs}, expected (1, registers, {D})")
    heads = args.get("num_heads") or HEADS.get(D)
    if not heads:
        raise CheckpointError(f"{source}: width {D} is not a DINOv3 entry point's; model_args.num_heads is needed")
    mlp, mlp_dim, split = timm_format._mlp(weights, source)
    qkv_bias = "blocks.0.attn.q_bias" in weights or "blocks.0.attn.qkv.bias" in weights
    if bool(args.get("qkv_bias", qkv_bias)) != qkv_bias:
        raise CheckpointError(f"{source}: model_args.qkv_bias={args['qkv_bias']!r}, but the weights say {qkv_bias}")
    pool = str(sidecar.get("global_pool") or args.get("global_pool") or "avg")
    if pool not in ("token", "avg"):
        raise CheckpointError(f"{source}: global_pool {pool!r} is not supported (token or avg)")
    size = args.get("img_size") or (sidecar.get("pretrained_cfg") or {}).get("input_size", [0, 224, 224])[1:]
    with refusing(source):
        cfg = ViTConfig(
            image_size=_size(size, source),
            patch_size=P,
            in_channels=C,
            num_classes=int(weights["head.weight"].shape[0]) if "head.weight" in weights else 0,
            hidden_size=D,
            depth=depth,
            num_heads=int(heads),
            mlp_dim=mlp_dim,
            classifier="token" if pool == "token" else "gap",
            class_token=True if "cls_token" in weights else None,
            num_registers=int(regs[1]),
            layer_norm_eps=float(sidecar.get("layer_norm_eps", EPS)),
            qkv_bias=qkv_bias,
            key_bias="blocks.0.attn.qkv.bias" in weights or not qkv_bias,
            layer_scale=float(args.get("init_values") or 1e-5) if "blocks.0.gamma_1" in weights else None,
            mlp=mlp,  # type: ignore[arg-type]
            patch_bias="patch_embed.proj.bias" in weights,
            pos_embed="none",
            rope="dinov3",
            rope_theta=float(args.get("rope_temperature", ROPE_TEMPERATURE)),
        )
    return cfg, args, split


def _size(size: Any, source: str) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(n, int) for n in size):
        return int(size[0]), int(size[1])
    raise CheckpointError(f"{source}: image size {size!r} is not an int or a pair of ints")


def load(path: Path) -> Checkpoint:
    """Read a timm Eva (DINOv3) state dict (file or hub folder) into vitkit's layout, shape-checked."""
    weights = timm_format.read_weights(path, ".safetensors/.pth")
    sidecar = timm_format._sidecar(path)
    cfg, args, split = infer_config(weights, sidecar, str(path))
    # rope.periods: RoPE's frequencies, a buffer timm computes (and leaves out of its state dicts); ignored if saved
    state = convert(cfg, weights, str(path), lambda c: key_map(c, split), ignore=lambda k: k == "rope.periods")
    doc = dict(sidecar or {})
    provenance: dict[str, Any] = {"layout": "timm Eva (DINOv3)", "architecture": doc.get("architecture")}
    if not args.get("num_heads"):
        provenance["num_heads"] = f"{cfg.num_heads} (the DINOv3 entry point of width {cfg.hidden_size})"
    return timm_format.checkpoint(path, cfg, state, doc, provenance, preprocess(doc, cfg), FORMAT)


def preprocess(doc: Mapping[str, Any], cfg: ViTConfig) -> Preprocess:
    """timm's ``pretrained_cfg``, else the Eva entry points' (ImageNet statistics, bicubic) at the model's size."""
    return timm_format.preprocess_from(doc, cfg.image_size) if doc.get("pretrained_cfg") else _default_preprocess(cfg)


def _default_preprocess(cfg: ViTConfig) -> Preprocess:
    return Preprocess(image_size=cfg.image_size, mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic")


# ---- writing ------------------------------------------------------------------------------------------


def check_representable(cfg: ViTConfig, target: str) -> None:
    """CheckpointError unless timm's Eva DINOv3 entry points compute exactly this model."""
    require(cfg.rope == "dinov3" and cfg.pos_embed == "none", target, "timm's DINOv3 has RoPE and no position table")
    require_unseen(cfg, target, rope="dinov3")
    require(cfg.classifier in ("token", "gap"), target, "timm's Eva pools the class token or the patch mean")
    require(cfg.layer_norm_eps == EPS, target, f"timm's DINOv3 entry points build LayerNorm eps {EPS}")
    require(cfg.mlp == "swiglu" or cfg.gelu == "exact", target, "timm's Eva MLP uses exact GELU")
    require(bool(cfg.class_token), target, "timm's DINOv3 has a class token")
    require(cfg.layer_scale not in (0, 0.0), target, "timm builds no layer scale for init_values=0")
    require(not (cfg.qkv_bias and cfg.key_bias), target, "timm's DINOv3 qkv bias has no key bias")
    extras = cfg.norm_pre or cfg.distilled or cfg.projection_size or cfg.representation_size
    require(cfg.patch_bias and not extras, target, "timm's DINOv3 has a patch bias and no pre-norm or extra heads")
    require(cfg.resnet_layers is None, target, "timm's Eva has no hybrid stem")


def timm_config(cfg: ViTConfig, meta: CheckpointMeta | None) -> dict[str, Any]:
    """timm's hub ``config.json`` for this model: the DINOv3 entry point of its width and model_args that override
    what differs (``timm.create_model(architecture, **model_args)`` rebuilds it)."""
    pre = meta.preprocess if meta else _default_preprocess(cfg)
    size = SIZES.get(cfg.hidden_size, "base")  # any entry point: model_args override what differs
    arch = f"vit_{size}_patch16_dinov3" + ("_qkvb" if cfg.qkv_bias or size == "tiny" else "")
    pool = "token" if cfg.classifier == "token" else "avg"
    args: dict[str, Any] = {
        **timm_writer.shape_args(cfg),
        "qkv_bias": cfg.qkv_bias,
        "init_values": cfg.layer_scale,
        "rope_type": "dinov3",
        "rope_temperature": cfg.rope_theta,
        "num_reg_tokens": cfg.num_registers,
        "swiglu_mlp": cfg.mlp == "swiglu",
        "global_pool": pool,
        "num_classes": cfg.num_classes,
        "mlp_ratio": timm_writer.mlp_ratio(cfg.mlp_dim, cfg.hidden_size),
    }
    if cfg.mlp == "swiglu":  # timm's SwiGLU width: int(D * mlp_ratio) rounded up to swiglu_align_to
        args["swiglu_align_to"] = 1
    return timm_writer.hub_config(cfg, arch, cfg.num_classes, pool, args, pre, meta)


def save(
    model: VisionTransformer, path: str | Path, meta: CheckpointMeta | None = None, *, overwrite: bool = False
) -> Path:
    """Write ``model`` as timm's Eva: a ``.safetensors`` file (timm's config in its metadata) or a hub folder (a
    bare ``.pth`` cannot carry the RoPE settings and is refused). Atomic; an existing file or vitkit-written folder
    is replaced only with ``overwrite``."""
    out = Path(path)
    timm_writer.check_output(out, overwrite)
    check_representable(model.cfg, "a timm Eva (DINOv3) state dict")
    return write(out, lambda: from_state_dict(key_map(model.cfg), export_state(model)), timm_config(model.cfg, meta),
                 overwrite)  # fmt: skip


def write(out: Path, arrays: Callable[[], Mapping[str, np.ndarray]], doc: dict[str, Any], overwrite: bool) -> Path:
    """timm's arrays (made once ``out`` is known to be no bare ``.pth``, which cannot carry the RoPE settings) with
    its config ``doc``: a ``.safetensors`` file (the config in its metadata) or a hub folder."""
    require(out.suffix not in torch_files.PICKLE_SUFFIXES, out.name,
            "a bare .pth cannot record the RoPE settings; write a .safetensors file or a folder")  # fmt: skip
    return timm_writer.write_with_config(out, torch_files.from_arrays(arrays()), doc, overwrite)
