"""``vitkit info``, ``vitkit convert``, ``vitkit export``: a model's architecture and cost, and its checkpoint
in other formats."""

from __future__ import annotations

import argparse
import json

from vitkit.commands.args import add_load_options, class_count, image_size, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_info(sub)
    _add_convert(sub)
    _add_export(sub)


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="architecture, parameter table, GMACs/GFLOPs of a variant or checkpoint",
        description="Show a model's configuration, a per-component parameter table, and the compute of one "
        "forward pass (GMACs, and GFLOPs at 2 FLOPs per multiply-add) at a given resolution.",
    )
    p.add_argument("model", help="a variant name such as B/16, or a checkpoint (path, URL, registry name, hub id)")
    p.add_argument("--image-size", type=image_size, help="resolution, e.g. 384 or 224x320 (default: model's)")
    p.add_argument(
        "--num-classes", type=class_count, help="number of classes of the head (default: 1000 / checkpoint's)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    from vitkit.checkpoints import loaded_from
    from vitkit.models.cost import cost_table

    # shapes only (the meta device): no memory, no init cost, even for H/14
    loaded = loaded_from(args.model, device="meta", num_classes=args.num_classes, image_size=args.image_size)
    model, sweep = loaded.model, loaded.meta.provenance.get("sweep")
    source, cfg = args.model, model.cfg
    rows = cost_table(model, args.image_size)
    total_params = sum(r.params for r in rows)
    total_macs = sum(r.macs for r in rows)
    size = args.image_size or cfg.image_size
    gh, gw = cfg.grid_at(size)
    summary = {
        "model": cfg.name or source,
        "image_size": list(size),
        "tokens": cfg.num_tokens(size),
        "config": cfg.to_dict(),
        "components": [{"component": r.component, "params": r.params, "macs": r.macs} for r in rows],
        "params": total_params,
        "gmacs": total_macs / 1e9,
        "gflops": 2 * total_macs / 1e9,
    } | ({"sweep": sweep} if sweep else {})
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['model']}: image {size[0]}x{size[1]}, {gh}x{gw} patches -> {summary['tokens']} tokens")
    print(
        f"  width {cfg.hidden_size}, depth {cfg.depth}, heads {cfg.num_heads}, MLP {cfg.mlp_dim}, "
        f"patch {cfg.patch_size}, classifier {cfg.classifier}, pos-emb {cfg.pos_embed}, GELU {cfg.gelu}, "
        f"classes {cfg.num_classes}"
        + (f", pre-logits {cfg.representation_size}" if cfg.representation_size else "")
        + (f", ResNet stages {list(cfg.resnet_layers)} (stride {cfg.stride})" if cfg.resnet_layers is not None else "")
    )
    print(f"  {'component':<28}{'params':>16}{'GMACs':>12}")
    for r in rows:
        print(f"  {r.component:<28}{r.params:>16,}{r.macs / 1e9:>12.4g}")
    print(f"  {'total':<28}{total_params:>16,}{total_macs / 1e9:>12.4g}")
    print(f"  {total_macs / 1e9:.4g} GMACs = {2 * total_macs / 1e9:.4g} GFLOPs per image (2 FLOPs per multiply-add)")
    if sweep:  # vitkit finetune --sweep lr
        tried = ", ".join(f"{lr} ({100 * top1:.2f}%)" for lr, top1 in sweep["val_top1"].items())
        print(f"  lr {sweep['chosen']:g} chosen by validation top-1 from: {tried}")
    return 0


# the formats ``convert --to`` writes: those of vitkit.checkpoints.FORMATS with a writer (a test holds them equal),
# named here so that building the parser imports no checkpoint code
WRITABLE_FORMATS = ("vitkit", "official", "big_vision", "hf", "timm", "timm_eva", "siglip")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to another format (vitkit, official, big_vision, hf, timm, timm_eva, siglip)",
        description="Read any supported checkpoint and write it in another format, keeping class names and "
        "preprocessing where the target can hold them. The written file is read back and its outputs compared "
        "with the source model on random images; the relative error is printed.",
    )
    p.add_argument("input", help="checkpoint path (file or folder)")
    p.add_argument("output", help="output path (.npz for official/big_vision/siglip; folder for vitkit/hf; "
                   ".safetensors/.pth or folder for timm)")  # fmt: skip
    p.add_argument("--to", required=True, choices=WRITABLE_FORMATS, help="output format")
    add_load_options(p)
    p.add_argument("--num-classes", type=class_count, help="replace the head by a zero-initialised one for N classes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file or vitkit-written folder")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from vitkit.checkpoints import check_save_target, load_checkpoint, save_checkpoint
    from vitkit.checkpoints.verify import compare_models

    # the output as the writer will judge it, before the (possibly long) load
    check_save_target(args.output, args.to, overwrite=args.overwrite, inputs=(args.input,))
    loaded = load_checkpoint(
        args.input,
        format=args.format,
        num_classes=args.num_classes,
        image_size=args.image_size,
        pos_interpolation=args.pos_interpolation,
    )
    out = save_checkpoint(loaded.model, args.output, args.to, meta=loaded.meta, overwrite=args.overwrite)
    again = load_checkpoint(out, format=args.to, image_size=loaded.model.cfg.image_size)
    err = compare_models(loaded.model, again.model)
    print(f"wrote {out} ({args.to}); read back: max abs err {err.max_abs_err:.3g}, rel err {err.rel_err:.3g}")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX, validated with onnxruntime",
        description="Export any supported checkpoint to ONNX (torch dynamo exporter) and check the file with "
        "onnxruntime against the PyTorch model on random images; prints the max abs and relative error.",
    )
    p.add_argument("checkpoint", help="checkpoint path (file or folder)")
    p.add_argument("output", help="output .onnx file")
    add_load_options(p)
    p.add_argument("--dynamic-batch", action="store_true", help="free batch axis (default: batch fixed at 2)")
    p.add_argument("--opset", type=positive_int, default=18, help="ONNX opset version (default 18)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.checkpoints import load_checkpoint
    from vitkit.checkpoints.onnx_export import export_onnx, validate_onnx
    from vitkit.output_paths import check_not_input, check_output_file

    check_not_input(Path(args.output), [args.checkpoint])
    check_output_file(Path(args.output), overwrite=args.overwrite)
    loaded = load_checkpoint(
        args.checkpoint, format=args.format, image_size=args.image_size, pos_interpolation=args.pos_interpolation
    )
    model = loaded.model
    metadata = {"preprocess": json.dumps(loaded.meta.preprocess.to_dict())}
    if loaded.meta.class_names:
        metadata["class_names"] = json.dumps(loaded.meta.class_names)
    out = export_onnx(
        model,
        args.output,
        dynamic_batch=args.dynamic_batch,
        opset=args.opset,
        metadata=metadata,
        overwrite=args.overwrite,
    )
    check = validate_onnx(model, out, (2, 3) if args.dynamic_batch else (2,))
    H, W = model.cfg.image_size
    print(
        f"wrote {out}: input images (B, {model.cfg.in_channels}, {H}, {W}), opset {args.opset}; onnxruntime vs "
        f"PyTorch on batch {', '.join(map(str, check.batch_sizes))}: max abs err {check.max_abs_err:.3g}, "
        f"rel err {check.rel_err:.3g}"
    )
    return 0
