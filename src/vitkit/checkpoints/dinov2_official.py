"""The official DINOv2 state dicts (facebookresearch/dinov2's hub ``.pth``: ``dinov2_vit{s,b,l,g}14[_reg]``).

Names (``dinov2/models/vision_transformer.py``), the timm layout but for three names::

    cls_token (1, 1, D)  pos_embed (1, 1 + N, D)  register_tokens (1, R, D)  mask_token (1, D)
    patch_embed.proj.{weight,bias}
    blocks.{i}.norm1, attn.qkv, attn.proj, ls1.gamma, norm2, mlp.fc1/fc2 (or SwiGLU's mlp.w12/w3), ls2.gamma
    norm

Training checkpoints built with ``block_chunks`` store the blocks as ``blocks.{chunk}.{i}.`` (the global block
index second); both forms are read. What the weights show is read from them: width, depth, patch size, grid
(``pos_embed`` has the class token's slot and a square grid: 1 + 37 x 37 at 518 px), registers (``register_tokens``:
after the class token, without position, as vitkit's ``num_registers``), the MLP (``w12`` with twice ``w3``'s
inputs: SwiGLU, gate rows first as vitkit's fc1). The rest is the code's and is fixed for every released
model: exact GELU, LayerNorm eps 1e-6 (qkv bias and layer scale, which every released model has, are read from
``blocks.0.attn.qkv.bias`` and ``blocks.0.ls1.gamma``). The number of heads shows in no shape: the four
released widths (384, 768, 1024, 1536) have 6, 12, 16 and 24; any other width is refused unless ``num_heads=``
is given. ``mask_token`` serves masked-image-modelling inputs only: ignored on reading. This is the layout
timm's ``checkpoint_filter_fn`` (``_convert_dinov2``) converts; the tests check vitkit against it.

Preprocessing: DINOv2's evaluation transform (bicubic resize of the shorter side to 256/224 of the crop, centre
crop, ImageNet mean/std), at the model's own grid. At another image size (the 518 px weights at 224 px) the
position grid is resampled as the official code's ``interpolate_pos_encoding`` resamples it: bicubic, not
antialiased, given the scale factor ``(n + 0.1) / M`` rather than the size (its default ``interpolate_offset=0.1``;
``pos_resample="bicubic_offset"``), so a file of the official hub gives the official model's features at any size
(tests/checkpoints/test_dinov2_resample.py). transformers' ``Dinov2Model`` resamples to the size instead
(``"bicubic_plain"``, as :mod:`vitkit.checkpoints.hf_dino` loads it) and timm with antialiasing (``"bicubic"``):
the same weights at 224 px give slightly different features from each of the three references, as they do there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vitkit.checkpoints import timm_format, torch_files
from vitkit.checkpoints.keymap import Rule, shape_reader
from vitkit.checkpoints.loaded import Checkpoint, CheckpointMeta, convert, refusing
from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from vitkit.errors import CheckpointError
from vitkit.models.posembed import grid_side
from vitkit.models.vit import ViTConfig

FORMAT = "dinov2"
SUFFIXES = (".safetensors", *torch_files.PICKLE_SUFFIXES)
HEADS = {384: 6, 768: 12, 1024: 16, 1536: 24}  # dinov2_vits14, vitb14, vitl14, vitg14
_CHUNKED = re.compile(r"blocks\.(\d+)\.(\d+)\.(.*)")


def key_map(cfg: ViTConfig) -> list[Rule]:
    """Official DINOv2 names for a model with this config (blocks expanded): timm's map, three names renamed."""
    out = []
    for r in timm_format.key_map(cfg):
        theirs = []
        for t in r.theirs:
            if cfg.mlp == "swiglu":  # SwiGLUFFNFused: w12 = [gate; up] (vitkit's fc1), w3
                t = t.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3.")
            theirs.append("register_tokens" if t == "reg_token" else t)
        out.append(replace(r, theirs=tuple(theirs)))
    return out


def looks_like(path: Path) -> bool:
    """An official DINOv2 state dict: ``patch_embed.proj.weight``, ``mask_token`` or ``register_tokens`` (which
    timm's and vitkit's layouts never hold) and blocks, plain or chunked."""
    if not (path.is_file() and path.suffix in SUFFIXES):
        return False
    keys = torch_files.readable_keys(path)
    blocks = "blocks.0.attn.qkv.weight" in keys or any(_CHUNKED.match(k) for k in keys)
    return "patch_embed.proj.weight" in keys and ("mask_token" in keys or "register_tokens" in keys) and blocks


def unchunk(weights: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``blocks.{chunk}.{i}.x`` -> ``blocks.{i}.x`` (block_chunks checkpoints); plain ones are returned as is."""
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        m = _CHUNKED.match(k)
        name = f"blocks.{m.group(2)}.{m.group(3)}" if m else k
        if name in out:
            raise CheckpointError(f"{source}: {k}: block {name.split('.')[1]} is stored twice")
        out[name] = v
    return out


def infer_config(weights: Mapping[str, torch.Tensor], source: str, *, num_heads: int | None = None) -> ViTConfig:
    """The architecture, from the shapes (module docstring)."""
    shape = shape_reader(weights, "DINOv2 state dict", source)
    D, C, P, P2 = shape("patch_embed.proj.weight")
    if P != P2:
        raise CheckpointError(f"{source}: patch_embed.proj.weight: non-square patches {P}x{P2}")
    heads = num_heads or HEADS.get(D)
    if heads is None:
        raise CheckpointError(
            f"{source}: width {D} is none of the released DINOv2 models' ({', '.join(map(str, HEADS))}), so the "
            "number of heads is unknown; pass num_heads="
        )
    registers = 0
    if "register_tokens" in weights:
        r = shape("register_tokens")
        if len(r) != 3 or r[0] != 1 or r[2] != D or r[1] < 1:
            raise CheckpointError(f"{source}: register_tokens has shape {r}, expected (1, R, {D})")
        registers = r[1]
    pe = shape("pos_embed")
    if len(pe) != 3 or pe[2] != D:
        raise CheckpointError(f"{source}: pos_embed has shape {pe}, expected (1, 1 + N, {D})")
    try:
        side = grid_side(pe[1] - 1)
    except ValueError:
        raise CheckpointError(f"{source}: pos_embed: {pe[1]} entries are not a class slot plus a square grid") from None
    if "blocks.0.mlp.w12.weight" in weights:
        h12, h3 = shape("blocks.0.mlp.w12.weight")[0], shape("blocks.0.mlp.w3.weight")[1]
        if h12 != 2 * h3:
            raise CheckpointError(f"{source}: blocks.0.mlp.w12.weight has {h12} outputs, not twice w3's {h3} inputs")
        mlp, mlp_dim = "swiglu", h3
    else:
        mlp, mlp_dim = "plain", shape("blocks.0.mlp.fc1.weight")[0]
    depth = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    with refusing(source):
        return ViTConfig(
            image_size=(side * P, side * P),
            patch_size=P,
            in_channels=C,
            num_classes=0,
            hidden_size=D,
            depth=depth,
            num_heads=int(heads),
            mlp_dim=mlp_dim,
            num_registers=registers,
            qkv_bias="blocks.0.attn.qkv.bias" in weights,
            layer_scale=1.0 if "blocks.0.ls1.gamma" in weights else None,  # hub init_values; only its initial value
            mlp=mlp,  # type: ignore[arg-type]
            pos_resample="bicubic_offset",  # the official interpolate_pos_encoding (interpolate_offset 0.1)
            name=f"DINOv2 {D}/{P}" + (f" reg{registers}" if registers else ""),
        )


def load(path: Path, *, num_heads: int | None = None) -> Checkpoint:
    """Read an official DINOv2 state dict into vitkit's layout, shape-checked."""
    if not (path.is_file() and path.suffix in SUFFIXES):
        raise CheckpointError(f"{path}: expected a {'/'.join(SUFFIXES)} file holding a DINOv2 state dict")
    weights = unchunk(torch_files.read_state_file(path), str(path))
    cfg = infer_config(weights, str(path), num_heads=num_heads)
    state = convert(cfg, weights, str(path), key_map, ignore=lambda k: k == "mask_token")
    provenance: dict[str, Any] = {"layout": "official DINOv2 (facebookresearch/dinov2)"}
    if num_heads is None:
        provenance["num_heads"] = f"{cfg.num_heads} (the released DINOv2 model of width {cfg.hidden_size})"
    meta = CheckpointMeta(
        format=FORMAT,
        source=str(path),
        preprocess=Preprocess(
            image_size=cfg.image_size,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            resize="crop",
            crop_pct=224 / 256,
            interpolation="bicubic",
        ),
        provenance=provenance,
    )
    return Checkpoint(cfg, state, meta)
