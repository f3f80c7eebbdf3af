"""Feeds the table "Checkpoint interop: error per format" of BENCHMARKS.md (``python benchmarks/run_all.py
interop``).

Measure, per checkpoint format, the relative error of vitkit against a real reference implementation.

    PYTHONPATH=src python benchmarks/interop_errors.py [--json F]

Relative error = ||ours - reference|| / ||reference|| on logits (or on the tokens, for the hybrid stem),
maximum over the cases listed. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

import vitkit
from vitkit.checkpoints import big_vision as bv
from vitkit.checkpoints import official as off
from vitkit.checkpoints import save_checkpoint
from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx

ROOT = Path(__file__).parents[1]
FIX = ROOT / "tests" / "fixtures"


def rel(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for m in model.modules():
            for name, p in m.named_parameters(recurse=False):
                p.normal_(0.0, 0.05)
                if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and name == "weight":
                    p.add_(1.0)
    return model.eval()


def golden() -> tuple[torch.Tensor, np.ndarray]:
    io = np.load(FIX / "official_vit_tiny.io.npz")
    return torch.from_numpy(io["inputs_nhwc"]).permute(0, 3, 1, 2), io["logits"]


@torch.no_grad()
def official(tmp: Path) -> float:
    x, ref = golden()
    return rel(vitkit.load_pretrained(FIX / "official_vit_tiny.npz")(x), ref)


@torch.no_grad()
def big_vision(tmp: Path) -> float:
    x, ref = golden()
    errs = []
    for scan in (False, True):
        arrays = {}
        for k, v in np.load(FIX / "official_vit_tiny.npz").items():
            k = k.replace("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0")
            arrays[k.replace("MlpBlock_3", "MlpBlock_0").replace("/LayerNorm_2/", "/LayerNorm_1/")] = v
        pe = arrays.pop("Transformer/posembed_input/pos_embedding")
        arrays["cls"], arrays["pos_embedding"] = arrays["cls"] + pe[:, :1], pe[:, 1:]
        arrays = bv.stack_scan(arrays, 2) if scan else arrays
        np.savez(tmp / "bv.npz", **{f"params/{k}": v for k, v in arrays.items()})
        errs.append(rel(vitkit.load_pretrained(tmp / "bv.npz")(x), ref))
    return max(errs)


def hf_cases() -> list[dict[str, object]]:
    return [{}, {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}, {"qkv_bias": False}]


@torch.no_grad()
def hf_in(tmp: Path) -> float:
    errs = []
    for kw in hf_cases():
        cfg = transformers.ViTConfig(
            hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=32,
            patch_size=8, num_labels=5, **kw,
        )  # fmt: skip
        ref = randomize(transformers.ViTForImageClassification(cfg))
        ref.save_pretrained(tmp / "hf")
        x = torch.randn(4, 3, 32, 32)
        errs.append(rel(vitkit.load_pretrained(tmp / "hf")(x), ref(pixel_values=x).logits))
    return max(errs)


@torch.no_grad()
def hf_out(tmp: Path) -> float:
    errs = []
    for i, kw in enumerate(({}, {"gelu": "tanh"}, {"qkv_bias": False}, {"pos_embed": "sincos2d"})):
        model = randomize(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=2, num_classes=5, **kw))
        save_checkpoint(model, tmp / f"out{i}", "hf")
        ref = transformers.ViTForImageClassification.from_pretrained(tmp / f"out{i}").eval()
        x = torch.randn(4, 3, 32, 32)
        errs.append(rel(ref(pixel_values=x).logits, model(x)))
    return max(errs)


@torch.no_grad()
def round_trip(tmp: Path, fmt: str, name: str, **kw: object) -> float:
    model = randomize(vitkit.create_model("Ti/16", image_size=32, patch_size=8, depth=2, num_classes=5, **kw))
    out = save_checkpoint(model, tmp / name, fmt)
    x = torch.randn(4, 3, 32, 32)
    return rel(vitkit.load_pretrained(out, image_size=32)(x), model(x))


@torch.no_grad()
def hybrid_npz(tmp: Path) -> float:
    model = randomize(
        vitkit.create_model("R50+B/16", image_size=64, depth=1, hidden_size=48, num_heads=3, mlp_dim=96,
                            resnet_layers=(1, 2), num_classes=5, gelu="tanh")
    )  # fmt: skip
    path = off.write(model.state_dict(), model.cfg, tmp / "h.npz")
    x = torch.randn(2, 3, 64, 64)
    return rel(vitkit.load_pretrained(path)(x), model(x))


def onnx(tmp: Path) -> float:
    errs = []
    for name, kw in [
        ("Ti/16", {"image_size": 32, "patch_size": 8, "depth": 2}),
        ("R50+B/16", {"image_size": 64, "depth": 1, "hidden_size": 48, "num_heads": 3, "mlp_dim": 96,
                      "resnet_layers": (1, 2)}),
    ]:  # fmt: skip
        model = randomize(vitkit.create_model(name, num_classes=5, **kw))
        path = tmp / f"m{len(errs)}.onnx"
        errs.append(validate_onnx(model, export_onnx(model, path, dynamic_batch=True), (1, 4)).rel_err)
    return max(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [
        ("official .npz (vit_jax)", "official implementation's golden logits", official),
        ("big_vision .npz (per-block, scan)", "official golden logits, re-laid out as big_vision", big_vision),
        ("HF folder -> vitkit", "transformers ViTForImageClassification, 3 configs", hf_in),
        ("vitkit -> HF folder", "transformers.from_pretrained of the export, 4 configs", hf_out),
        ("timm .safetensors round trip", "vitkit model", lambda t: round_trip(t, "timm", "t.safetensors")),
        (
            "big_vision round trip (class slot folded)",
            "vitkit model",
            lambda t: round_trip(t, "big_vision", "b.npz", gelu="tanh"),
        ),
        ("vitkit folder round trip", "vitkit model", lambda t: round_trip(t, "vitkit", "v")),
        ("hybrid official .npz round trip", "vitkit model", hybrid_npz),
        ("ONNX (plain + hybrid)", "onnxruntime vs PyTorch", onnx),
    ]
    print("| format | reference | max relative error |\n|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name, ref, fn in rows:
            err = float(fn(Path(d)))
            results.append({"format": name, "reference": ref, "max_rel_error": err})
            print(f"| {name} | {ref} | {err:.2g} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
