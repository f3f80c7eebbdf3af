"""Writes src/vitkit/resources/vit_families.json: the public DINOv2, DINOv3, EVA-02, SigLIP, CLIP and DeiT checkpoints.

Sources (nothing here was downloaded; sha256 and sizes are null, recorded by huggingface_hub on download):
- transformers folders: the architecture fields of each repository's config.json (hidden size, depth, heads,
  patch, image size, activation, eps, registers, projection), as transformers' conversion scripts write them
  (transformers 5.24, models/{dinov2,dinov2_with_registers,dinov3_vit,siglip,clip,deit}/convert_*.py), and the image
  processor each names (BitImageProcessor, SiglipImageProcessor, CLIPImageProcessor, DeiTImageProcessor).
- timm: the entry points and pretrained configs of timm 1.0.31 (timm/models/vision_transformer.py, deit.py, eva.py):
  model_args, input_size, crop_pct, interpolation, mean/std; timm builds SigLIP towers with nn.GELU (no
  act_layer) and ``vit_*_clip_224`` with nn.GELU too (its note: "natively QuickGELU, use quickgelu model
  variant for original results"), LayerNorm eps 1e-5 for CLIP in code: what load_options passes on.
- SigLIP 2: the fixed-resolution checkpoints are SigLIP's layout (model_type ``siglip``, transformers docs:
  "FixRes ... backwards compatible with SigLIP"); the NaFlex ones are model_type ``siglip2``.

``vitkit_config`` of a transformers entry is what vitkit's loader builds from the config.json fields
(:func:`vitkit.checkpoints.families.loader_config`); of a timm entry it is written here and checked by
tests/hub/test_family_registry.py against the loader run on real timm's state dict. ``params``: vitkit's model.

Run: PYTHONPATH=src python tools/build_families.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vitkit.checkpoints.families import config_fields, loader_config, param_count, registry_config
from vitkit.hub.families import FamilyEntry

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
HALF = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}
OPENAI = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}
SIZES = {192: "Ti", 384: "S", 768: "B", 1024: "L", 1152: "So400m", 1280: "H", 1536: "g", 4096: "7B"}
WIDTHS = {"S": (384, 6), "B": (768, 12), "L": (1024, 16), "g": (1536, 24)}
DEPTHS = {"S": 12, "B": 12, "L": 24, "g": 40}
HF_SRC = "transformers config.json / preprocessor_config.json of https://huggingface.co/{}"
TIMM_SRC = "timm 1.0.31 pretrained config {} (timm/models/{}.py)"

SO400M = (
    "384 px is no multiple of the 14 px patch: the reference patch embedding drops the last 6 pixel rows "
    "and columns (a 27x27 grid); vitkit's ViT takes only image sizes its patch divides"
)
EMBEDDING = {
    "dinov2": "class token",
    "dinov3": "class token",
    "eva02": "patch mean, fc_norm",
    "siglip": "MAP output",
    "clip": "projected embedding",
    "deit": "logits (mean of both heads); features: class token",
}


def hf_entry(
    repo: str,
    family: str,
    config: dict[str, Any],
    pre: dict[str, Any],
    aliases: list[str],
    notes: str | None = None,
    refused: str | None = None,
) -> dict[str, Any]:
    return {
        "name": repo,
        "aliases": list(dict.fromkeys(aliases)),
        "family": family,
        "repo_id": repo,
        "format": "hf",
        "config": config,
        "load_options": {},
        "preprocess": pre,
        "source": HF_SRC.format(repo),
        "notes": notes,
        "refused": refused,
    }


def timm_entry(
    name: str,
    family: str,
    arch: dict[str, Any],
    vitkit: dict[str, Any],
    pre: dict[str, Any],
    load_options: dict[str, Any] | None = None,
    notes: str | None = None,
    module: str | None = None,
    format: str = "timm",
) -> dict[str, Any]:
    module = module or ("deit" if family == "deit" else "vision_transformer")
    return {
        "name": f"timm/{name}",
        "aliases": [name],
        "family": family,
        "repo_id": f"timm/{name}",
        "format": format,
        "config": arch,
        "vitkit_config": vitkit,
        "load_options": load_options or {},
        "preprocess": pre,
        "source": TIMM_SRC.format(name, module),
        "notes": notes,
        "refused": None,
    }


def dinov2() -> list[dict[str, Any]]:
    out = []
    pre = {
        "processor": "BitImageProcessor",
        "resize": "shortest",
        "resize_to": 256,
        "crop": 224,
        "interpolation": "bicubic",
        **IMAGENET,
    }
    for reg in (False, True):
        for size, word in (("S", "small"), ("B", "base"), ("L", "large"), ("g", "giant")):
            D, heads = WIDTHS[size]
            repo = f"facebook/dinov2-{'with-registers-' if reg else ''}{word}"
            config = {
                "model_type": "dinov2_with_registers" if reg else "dinov2",
                "hidden_size": D,
                "num_hidden_layers": DEPTHS[size],
                "num_attention_heads": heads,
                "mlp_ratio": 4,
                "patch_size": 14,
                "image_size": 518,
                "hidden_act": "gelu",
                "layer_norm_eps": 1e-6,
                "layerscale_value": 1.0,
                "qkv_bias": True,
                "use_swiglu_ffn": size == "g",
            }
            if reg:
                config["num_register_tokens"] = 4
            alias = f"dinov2-{'reg4-' if reg else ''}{word}"
            out.append(hf_entry(repo, "dinov2", config, pre, [alias, repo.split("/")[1]]))
    for size, word in (("S", "small"), ("B", "base"), ("L", "large")):
        D, heads = WIDTHS[size]
        for reg in (False, True):
            name = f"vit_{word}_patch14_{'reg4_' if reg else ''}dinov2.lvd142m"
            args = {
                "patch_size": 14,
                "embed_dim": D,
                "depth": DEPTHS[size],
                "num_heads": heads,
                "init_values": 1e-5,
                "img_size": 518,
                "num_classes": 0,
                **({"reg_tokens": 4, "no_embed_class": True} if reg else {}),
            }
            vitkit = {
                "image_size": [518, 518],
                "patch_size": 14,
                "num_classes": 0,
                "hidden_size": D,
                "depth": DEPTHS[size],
                "num_heads": heads,
                "mlp_dim": 4 * D,
                "layer_scale": 1e-5,
                **({"num_registers": 4} if reg else {}),
            }
            pre = {
                "processor": "timm",
                "resize": "crop",
                "crop_pct": 1.0,
                "crop": 518,
                "interpolation": "bicubic",
                **IMAGENET,
            }
            out.append(
                timm_entry(name, "dinov2", {"architecture": name.split(".")[0], "model_args": args}, vitkit, pre)
            )
    return out


def dinov3() -> list[dict[str, Any]]:
    """The DINOv3 ViTs on LVD-1689M: the 7B and those distilled from it, with the architecture fields of their
    config.json (patch 16, 4 registers, RoPE base 100, no key bias, LayerNorm eps 1e-5; S+, H+ and 7B gated with
    silu). Nothing was downloaded: the parameter counts are checked against facebookresearch/dinov3's model table
    (21M, 29M, 86M, 300M, 840M, 6716M) by tests/checkpoints/test_hf_dinov3.py."""
    pre = {
        "processor": "DINOv3ViTImageProcessorFast",
        "resize": "squash",
        "crop": 224,
        "interpolation": "bilinear",
        **IMAGENET,
    }
    models = [  # name, hidden, depth, heads, intermediate, gated
        ("vits16", 384, 12, 6, 1536, False),
        ("vits16plus", 384, 12, 6, 1536, True),
        ("vitb16", 768, 12, 12, 3072, False),
        ("vitl16", 1024, 24, 16, 4096, False),
        ("vith16plus", 1280, 32, 20, 5120, True),
        ("vit7b16", 4096, 40, 32, 8192, True),
    ]
    out = []
    for name, D, depth, heads, hidden, gated in models:
        repo = f"facebook/dinov3-{name}-pretrain-lvd1689m"
        config = {
            "model_type": "dinov3_vit",
            "hidden_size": D,
            "num_hidden_layers": depth,
            "num_attention_heads": heads,
            "intermediate_size": hidden,
            "patch_size": 16,
            "image_size": 224,
            "hidden_act": "silu" if gated else "gelu",
            "use_gated_mlp": gated,
            "layer_norm_eps": 1e-5,
            "layerscale_value": 1.0,
            "num_register_tokens": 4,
            "rope_theta": 100.0,
            "query_bias": True,
            "key_bias": False,
            "value_bias": True,
        }
        out.append(hf_entry(repo, "dinov3", config, pre, [f"dinov3-{name}", repo.split("/")[1]]))
    return out


def dinov3_timm() -> list[dict[str, Any]]:
    """timm's DINOv3 (timm 1.0.31 timm/models/eva.py: the Eva class, default_cfgs of ``_dinov3_cfg``): the
    LVD-1689M models with and without the (zero) qkv bias, and the SAT-493M satellite models with their own
    statistics. timm's hub config.json pools the patch mean (``global_pool`` "avg", Eva's default; upstream DINOv3
    uses the class token: ``--pool cls``), 256 px, bicubic, crop_pct 1.0."""
    sat = {"mean": [0.430, 0.411, 0.296], "std": [0.213, 0.156, 0.143]}
    models = [  # entry size, hidden, depth, heads, SwiGLU hidden (timm's swiglu_align_to rounding) or None
        ("small", 384, 12, 6, None),
        ("small_plus", 384, 12, 6, 1536),
        ("base", 768, 12, 12, None),
        ("large", 1024, 24, 16, None),
        ("huge_plus", 1280, 32, 20, 5120),
        ("7b", 4096, 40, 32, 8192),
    ]
    out = []
    for size, D, depth, heads, swiglu in models:
        tags = {"lvd1689m": IMAGENET, **({"sat493m": sat} if size in ("large", "7b") else {})}
        for tag, stats in tags.items():
            for qkvb in (False, True) if size != "7b" else (False,):
                if qkvb and tag == "sat493m" and size == "7b":
                    continue
                arch = f"vit_{size}_patch16_dinov3" + ("_qkvb" if qkvb else "")
                name = f"{arch}.{tag}"
                vitkit = {
                    "image_size": [256, 256],
                    "patch_size": 16,
                    "num_classes": 0,
                    "hidden_size": D,
                    "depth": depth,
                    "num_heads": heads,
                    "mlp_dim": swiglu or 4 * D,
                    "classifier": "gap",
                    "class_token": True,
                    "num_registers": 4,
                    "layer_norm_eps": 1e-5,
                    "qkv_bias": qkvb,
                    "key_bias": not qkvb,
                    "layer_scale": 1e-5,
                    "mlp": "swiglu" if swiglu else "plain",
                    "pos_embed": "none",
                    "rope": "dinov3",
                    "rope_theta": 100.0,
                }
                pre = {"processor": "timm", "resize": "crop", "crop_pct": 1.0, "crop": 256, "interpolation": "bicubic",
                       **stats}  # fmt: skip
                config = {"architecture": arch, "global_pool": "avg", "model_args": {}}
                entry = timm_entry(name, "dinov3", config, vitkit, pre, module="eva", format="timm_eva")
                entry["embedding"] = "patch mean (timm's global_pool avg; --pool cls: the class token)"
                out.append(entry)
    return out


def eva02_timm() -> list[dict[str, Any]]:
    """timm's EVA-02 (timm 1.0.31 timm/models/eva.py: the Eva class, default_cfgs of ``_cfg``): the MIM towers
    (IN-22k, Merged-38M; 224 px, no head, crop_pct 0.9) and their ImageNet fine-tunes (336 / 448 px, crop_pct 1.0,
    squashed where timm's config says ``crop_mode='squash'``), OpenAI CLIP's statistics, bicubic. Patch 14, SwiGLU of
    int(D * 4 * 2 / 3) with a LayerNorm inside it in B and L, RoPE with ref_feat_shape 16 x 16 beside a learned position
    table, the patch mean after fc_norm (timm's global_pool "avg"). EVA-CLIP's image towers (Merged-2B, ``_cfg``'s
    crop_pct 0.9 at 224, 1.0 at 336) add a LayerNorm inside the attention, pool the class token after norm and hold
    the CLIP projection as timm's head (512 / 768 "classes", the image embedding)."""
    shapes = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16)}
    models = [  # (entry point, tag, classes, timm's crop_mode squash)
        *[(f"eva02_{s}_patch14_224", "mim_in22k", 0, False) for s in shapes],
        ("eva02_large_patch14_224", "mim_m38m", 0, False),
        ("eva02_tiny_patch14_336", "mim_in22k_ft_in1k", 1000, False),
        ("eva02_small_patch14_336", "mim_in22k_ft_in1k", 1000, False),
        *[(f"eva02_{s}_patch14_448", "mim_in22k_ft_in1k", 1000, False) for s in ("base", "large")],
        ("eva02_large_patch14_448", "mim_m38m_ft_in1k", 1000, False),
        *[(f"eva02_{s}_patch14_448", "mim_in22k_ft_in22k_in1k", 1000, True) for s in ("base", "large")],
        ("eva02_large_patch14_448", "mim_m38m_ft_in22k_in1k", 1000, True),
        *[(f"eva02_{s}_patch14_448", "mim_in22k_ft_in22k", 21841, True) for s in ("base", "large")],
        ("eva02_large_patch14_448", "mim_m38m_ft_in22k", 21841, True),
        ("eva02_base_patch16_clip_224", "merged2b", 512, False),
        *[(f"eva02_large_patch14_clip_{r}", "merged2b", 768, False) for r in (224, 336)],
    ]
    out = []
    for arch, tag, classes, squash in models:
        size, res, clip = arch.split("_")[1], int(arch.rsplit("_", 1)[1]), "_clip_" in arch
        D, depth, heads = shapes[size]
        vitkit = {
            "image_size": [res, res],
            "patch_size": 16 if "patch16" in arch else 14,
            "num_classes": classes,
            "hidden_size": D,
            "depth": depth,
            "num_heads": heads,
            "mlp_dim": int(D * 4 * 2 / 3),
            "classifier": "token" if clip else "gap",
            "class_token": True,
            "pos_resample": "bicubic",
            "key_bias": False,
            "mlp": "swiglu",
            "mlp_norm": size in ("base", "large"),
            "attn_norm": clip,
            "fc_norm": not clip,
            "rope": "eva",
            "rope_theta": 10000.0,
            "rope_ref_grid": [16, 16],
        }
        crop_pct = 0.9 if res == 224 else 1.0
        pre = {"processor": "timm", "resize": "squash" if squash else "crop", "crop_pct": crop_pct, "crop": res,
               "interpolation": "bicubic", **OPENAI}  # fmt: skip
        config = {
            "architecture": arch,
            "global_pool": "token" if clip else "avg",
            "model_args": {"num_classes": classes} if classes > 1000 else {},
        }
        entry = timm_entry(f"{arch}.{tag}", "eva02", config, vitkit, pre, module="eva", format="timm_eva")
        entry["embedding"] = "class token, norm" if clip else "patch mean, fc_norm"  # timm's global_pool
        if clip:
            entry["notes"] = f"EVA-CLIP: the CLIP image embedding is timm's head ({classes} wide; predict --logits)"
        out.append(entry)
    return out


def siglip() -> list[dict[str, Any]]:
    out = []
    shapes = {"B/16": (768, 12, 12, 3072, 16), "L/16": (1024, 24, 16, 4096, 16), "So400m/14": (1152, 27, 16, 4304, 14)}
    models = [
        ("google/siglip-base-patch16-224", "B/16", 224),
        ("google/siglip-base-patch16-256", "B/16", 256),
        ("google/siglip-base-patch16-384", "B/16", 384),
        ("google/siglip-base-patch16-512", "B/16", 512),
        ("google/siglip-large-patch16-256", "L/16", 256),
        ("google/siglip-large-patch16-384", "L/16", 384),
        ("google/siglip-so400m-patch14-384", "So400m/14", 384),
        ("google/siglip2-base-patch16-224", "B/16", 224),
        ("google/siglip2-base-patch16-256", "B/16", 256),
        ("google/siglip2-base-patch16-384", "B/16", 384),
        ("google/siglip2-base-patch16-512", "B/16", 512),
        ("google/siglip2-large-patch16-256", "L/16", 256),
        ("google/siglip2-so400m-patch14-384", "So400m/14", 384),
    ]
    for repo, shape, res in models:
        D, depth, heads, mlp, patch = shapes[shape]
        v2 = "siglip2" in repo
        vision = {
            "hidden_size": D,
            "num_hidden_layers": depth,
            "num_attention_heads": heads,
            "intermediate_size": mlp,
            "patch_size": patch,
            "image_size": res,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        }
        pre = {
            "processor": "SiglipImageProcessor",
            "resize": "squash",
            "crop": res,
            "interpolation": None if v2 else "bicubic",
            **HALF,
        }
        notes = "SigLIP 2, fixed resolution: SigLIP's layout (model_type siglip)" if v2 else None
        short = repo.split("/")[1]
        config = {"model_type": "siglip", "vision_config": vision}
        out.append(hf_entry(repo, "siglip", config, pre, [short], notes, SO400M if patch == 14 else None))
    naflex = {
        "model_type": "siglip2",
        "vision_config": {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "patch_size": 16,
            "num_patches": 256,
        },
    }
    why = (
        "SigLIP 2 NaFlex (model_type siglip2): a linear patch embedding over flattened patches, a 16x16 position "
        "grid resized to each image's aspect-preserving grid and an attention mask over padded patches; vitkit's "
        "ViT has none of these (the fixed-resolution SigLIP 2 checkpoints load)"
    )
    out.append(
        hf_entry(
            "google/siglip2-base-patch16-naflex", "siglip", naflex, {}, ["siglip2-base-patch16-naflex"], refused=why
        )
    )
    timm_models = [
        ("vit_base_patch16_siglip_224.webli", 224, "B/16"),
        ("vit_base_patch16_siglip_256.webli", 256, "B/16"),
        ("vit_base_patch16_siglip_384.webli", 384, "B/16"),
        ("vit_so400m_patch14_siglip_384.webli", 384, "So400m/14"),
    ]
    for name, res, shape in timm_models:
        D, depth, heads, mlp, patch = shapes[shape]
        args = {
            "patch_size": patch,
            "embed_dim": D,
            "depth": depth,
            "num_heads": heads,
            "class_token": False,
            "global_pool": "map",
            "img_size": res,
            "num_classes": 0,
        }
        if shape.startswith("So400m"):
            args["mlp_ratio"] = 3.7362
        vitkit = {
            "image_size": [res, res],
            "patch_size": patch,
            "num_classes": 0,
            "hidden_size": D,
            "depth": depth,
            "num_heads": heads,
            "mlp_dim": mlp,
            "classifier": "map",
            "class_token": False,
        }
        pre = {"processor": "timm", "resize": "crop", "crop_pct": 0.9, "crop": res, "interpolation": "bicubic", **HALF}
        note = "timm builds its SigLIP towers with exact GELU (big_vision and transformers: tanh GELU)"
        entry = timm_entry(
            name,
            "siglip",
            {"architecture": name.split(".")[0], "model_args": args},
            vitkit,
            pre,
            {"gelu": "exact"},
            note,
        )
        out.append({**entry, "refused": SO400M if patch == 14 else None})
    return out


def clip() -> list[dict[str, Any]]:
    out = []
    models = [
        ("openai/clip-vit-base-patch32", 768, 12, 12, 3072, 32, 224, 512),
        ("openai/clip-vit-base-patch16", 768, 12, 12, 3072, 16, 224, 512),
        ("openai/clip-vit-large-patch14", 1024, 24, 16, 4096, 14, 224, 768),
        ("openai/clip-vit-large-patch14-336", 1024, 24, 16, 4096, 14, 336, 768),
    ]
    for repo, D, depth, heads, mlp, patch, res, proj in models:
        vision = {
            "hidden_size": D,
            "num_hidden_layers": depth,
            "num_attention_heads": heads,
            "intermediate_size": mlp,
            "patch_size": patch,
            "image_size": res,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        }
        pre = {
            "processor": "CLIPImageProcessor",
            "resize": "shortest",
            "resize_to": res,
            "crop": res,
            "interpolation": "bicubic",
            **OPENAI,
        }
        config = {"model_type": "clip", "projection_dim": proj, "vision_config": vision}
        out.append(hf_entry(repo, "clip", config, pre, [repo.split("/")[1]]))
    timm_models = [
        ("vit_base_patch32_clip_224", 768, 12, 12, 32, 512),
        ("vit_base_patch16_clip_224", 768, 12, 12, 16, 512),
        ("vit_large_patch14_clip_224", 1024, 24, 16, 14, 768),
    ]
    for arch, D, depth, heads, patch, proj in timm_models:
        for quick in (False, True):
            name = (arch.replace("_clip_", "_clip_quickgelu_") if quick else arch) + ".openai"
            args = {
                "patch_size": patch,
                "embed_dim": D,
                "depth": depth,
                "num_heads": heads,
                "pre_norm": True,
                "num_classes": proj,
                **({"act_layer": "quick_gelu"} if quick else {}),
            }
            # timm's projection is its head (Linear with a bias, zeros in these weights): loaded as that head
            vitkit = {
                "patch_size": patch,
                "num_classes": proj,
                "hidden_size": D,
                "depth": depth,
                "num_heads": heads,
                "mlp_dim": 4 * D,
                "gelu": "quick" if quick else "exact",
                "layer_norm_eps": 1e-5,
                "norm_pre": True,
                "patch_bias": False,
            }
            pre = {
                "processor": "timm",
                "resize": "crop",
                "crop_pct": 0.9,
                "crop": 224,
                "interpolation": "bicubic",
                **OPENAI,
            }
            note = (
                None
                if quick
                else (
                    "timm runs these OpenAI weights with exact GELU, as its entry point defines "
                    "(OpenAI trained them with QuickGELU: the _quickgelu_ name is the original)"
                )
            )
            options = {"gelu": "quick" if quick else "exact", "layer_norm_eps": 1e-5}
            out.append(
                timm_entry(
                    name, "clip", {"architecture": name.split(".")[0], "model_args": args}, vitkit, pre, options, note
                )
            )
    return out


def deit() -> list[dict[str, Any]]:
    out = []
    for word, D, heads in (("tiny", 192, 3), ("small", 384, 6), ("base", 768, 12)):
        repo = f"facebook/deit-{word}-distilled-patch16-224"
        config = {
            "model_type": "deit",
            "hidden_size": D,
            "num_hidden_layers": 12,
            "num_attention_heads": heads,
            "intermediate_size": 4 * D,
            "patch_size": 16,
            "image_size": 224,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-12,
            "num_labels": 1000,
        }
        pre = {
            "processor": "DeiTImageProcessor",
            "resize": "squash_crop",
            "resize_to": 256,
            "crop": 224,
            "interpolation": "bicubic",
            **IMAGENET,
        }
        out.append(hf_entry(repo, "deit", config, pre, [repo.split("/")[1]]))
        name = f"deit_{word}_distilled_patch16_224.fb_in1k"
        args = {"patch_size": 16, "embed_dim": D, "depth": 12, "num_heads": heads, "num_classes": 1000}
        vitkit = {"num_classes": 1000, "hidden_size": D, "num_heads": heads, "mlp_dim": 4 * D, "distilled": True}
        pre = {
            "processor": "timm",
            "resize": "crop",
            "crop_pct": 0.9,
            "crop": 224,
            "interpolation": "bicubic",
            **IMAGENET,
        }
        out.append(timm_entry(name, "deit", {"architecture": name.split(".")[0], "model_args": args}, vitkit, pre))
    return out


def architecture(cfg_fields: dict[str, Any]) -> str:
    D, patch = cfg_fields.get("hidden_size", 768), cfg_fields.get("patch_size", 16)
    regs = cfg_fields.get("num_registers", 0)
    return f"{SIZES.get(D, D)}/{patch}" + (f"+reg{regs}" if regs else "")


def finish(d: dict[str, Any]) -> dict[str, Any]:
    """Add the computed fields: vitkit's config (the loader's, for transformers entries), arch, params."""
    probe = FamilyEntry.from_dict(
        {
            **d,
            "vitkit_config": d.get("vitkit_config", {}),
            "architecture": "",
            "embedding": "",
            "resolution": 0,
            "params": 0,
            "size_mib": None,
            "sha256": None,
        }
    )
    if d["refused"]:
        vision = d["config"].get("vision_config") or d["config"].get("model_args") or {}
        fields = {
            "hidden_size": vision.get("hidden_size") or vision.get("embed_dim"),
            "patch_size": vision.get("patch_size"),
        }
        params = 0
    else:
        cfg = loader_config(probe) or registry_config(probe)
        fields = config_fields(cfg)
        params = param_count(cfg)
    resolution = d["preprocess"].get("crop") or 0
    return {
        "name": d["name"],
        "aliases": d["aliases"],
        "family": d["family"],
        "architecture": architecture(fields),
        "repo_id": d["repo_id"],
        "format": d["format"],
        "config": d["config"],
        "vitkit_config": {} if d["refused"] else fields,
        "load_options": d["load_options"],
        "embedding": d.get("embedding") or EMBEDDING[d["family"]],
        "resolution": resolution,
        "preprocess": d["preprocess"],
        "params": params,
        "refused": d["refused"],
        "size_mib": None,
        "sha256": None,
        "source": d["source"],
        "notes": d["notes"],
    }


def main() -> None:
    models = [finish(d) for d in [*dinov2(), *dinov3(), *dinov3_timm(), *eva02_timm(), *siglip(), *clip(), *deit()]]
    doc = {
        "about": "Public checkpoints of the modern ViT families on the Hugging Face Hub (transformers and timm "
        "folders). params: vitkit's model as loaded (heads and projection included, DINOv2's mask_token not). "
        "sha256 and sizes are null: huggingface_hub checks and caches the files. Generated by tools/build_families.py.",
        "models": models,
    }
    out = Path(__file__).parents[1] / "src" / "vitkit" / "resources" / "vit_families.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{out}: {len(models)} entries")


if __name__ == "__main__":
    main()
