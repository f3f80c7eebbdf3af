"""Feeds the table "Model families: the fast path against transformers" of BENCHMARKS.md: vitkit's fast path (bf16,
int8) against transformers' own model of the family, in one process, calls alternating, the same architecture
with random weights (speed does not depend on the values; the parameter counts are checked equal, so both run the
same model).

    python benchmarks/families.py dinov2-s14-reg4 siglip-b16 --batch-size 32 --repeats 5 --json out.json

transformers' configurations tried: fp32 and bf16 (weights cast, as its docs do for inference), each with the
``sdpa`` and ``eager`` attention; its best is the reference of every ratio. A vitkit figure is refused (the run
fails) when the fast path did not run: the engine must be vitkit's ``InferenceViT``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vitkit.inference.fast import InferenceViT, optimize_for_inference
from vitkit.models.vit import VisionTransformer, ViTConfig


def dinov2_s14_reg4(size: int) -> tuple[torch.nn.Module, VisionTransformer]:
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    hf_cfg = Dinov2WithRegistersConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, patch_size=14,
        image_size=518, num_register_tokens=4, layerscale_value=1.0,
    )  # fmt: skip
    ours = ViTConfig(
        image_size=518, patch_size=14, hidden_size=384, depth=12, num_heads=6, mlp_dim=1536, num_classes=0,
        num_registers=4, layer_scale=1.0, pos_resample="bicubic_plain",
    )  # fmt: skip
    model = VisionTransformer(ours)
    model.resize_image(size)
    return Dinov2WithRegistersModel(hf_cfg), model


def siglip_b16(size: int) -> tuple[torch.nn.Module, VisionTransformer]:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    hf_cfg = SiglipVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=size,
        patch_size=16,
    )  # fmt: skip
    ours = ViTConfig(
        image_size=size, patch_size=16, hidden_size=768, depth=12, num_heads=12, mlp_dim=3072, num_classes=0,
        classifier="map", gelu="tanh",
    )  # fmt: skip
    return SiglipVisionModel(hf_cfg), VisionTransformer(ours)


MODELS: dict[str, tuple[Callable[[int], tuple[torch.nn.Module, VisionTransformer]], int]] = {
    "dinov2-s14-reg4": (dinov2_s14_reg4, 224),
    "siglip-b16": (siglip_b16, 224),
}


def _params(m: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for n, p in m.named_parameters() if not any(s in n for s in skip))


def _time(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Seconds per call, median over ``repeats`` rounds in which every function runs once (alternating)."""
    for fn in fns.values():
        fn()  # warm-up: packing, kernel loading, first-call allocations
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def run(name: str, batch: int, repeats: int) -> dict[str, Any]:
    build, size = MODELS[name]
    hf, ours = build(size)
    hf.eval()
    ours.eval()
    # DINOv2's mask token is for its training only; vitkit's position embedding is resampled to the image size
    # once (``resize_image``), transformers' at every call
    hf_params = _params(hf, skip=("mask_token", "position_embedding"))  # DINOv2 ...embeddings, SigLIP ...embedding
    our_params = _params(ours, skip=("pos_embed",))
    if hf_params != our_params:
        raise SystemExit(f"{name}: transformers has {hf_params} parameters, vitkit {our_params}: not the same model")
    x = torch.randn(batch, 3, size, size)
    fns: dict[str, Callable[[], Any]] = {}
    for attn in ("sdpa", "eager"):
        for dtype in (torch.float32, torch.bfloat16):
            m = type(hf)(hf.config.__class__(**{**hf.config.to_dict(), "_attn_implementation": attn}))
            m.load_state_dict(hf.state_dict())
            m = m.to(dtype).eval()
            xi = x.to(dtype)
            fns[f"transformers {attn} {str(dtype)[6:]}"] = lambda m=m, xi=xi: m(pixel_values=xi).pooler_output
    engines = {
        "vitkit fast bf16": optimize_for_inference(ours, torch.bfloat16, batch_size=batch),
        "vitkit fast int8": optimize_for_inference(ours, torch.bfloat16, batch_size=batch, int8=True),
    }
    for label, fast in engines.items():
        if not isinstance(fast, InferenceViT):
            raise SystemExit(f"{label}: the fast path did not run (got {type(fast).__name__})")
        fns[label] = lambda f=fast: f.forward_head(f.forward_features(x), pre_logits=True)
    with torch.inference_mode():
        secs = _time(fns, repeats)
    ips = {k: batch / v for k, v in secs.items()}
    best_hf = max((v, k) for k, v in ips.items() if k.startswith("transformers"))
    return {
        "model": name,
        "image_size": size,
        "batch": batch,
        "images_per_s": ips,
        "transformers_best": best_hf[1],
        "fast_bf16_over_transformers": ips["vitkit fast bf16"] / best_hf[0],
        "int8_over_fast_bf16": ips["vitkit fast int8"] / ips["vitkit fast bf16"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    results = [run(m, args.batch_size, args.repeats) for m in args.models]
    report = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "results": results}
    for r in results:
        print(f"{r['model']} b{r['batch']} {r['image_size']}px")
        for k, v in sorted(r["images_per_s"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v:8.2f} img/s")
        print(f"  fast bf16 / transformers best ({r['transformers_best']}): {r['fast_bf16_over_transformers']:.2f}x")
        print(f"  int8 / fast bf16: {r['int8_over_fast_bf16']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
