"""``vitkit predict``: top-k labels for image files (the loop is :func:`vitkit.predict`)."""

from __future__ import annotations

import argparse
import json

from vitkit.commands.args import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_predict(sub)


def _add_predict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="top-k labels for images with a checkpoint",
        description="Classify images with any supported checkpoint. Preprocessing (resize, mean/std) is "
        "taken from the checkpoint; labels from its class names when it has them.",
    )
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument(
        "--checkpoint", "-c", required=True, help="checkpoint: a path, URL, registry name (vitkit models) or hub id"
    )
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--top-k", type=positive_int, default=5, help="how many labels per image (default 5)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per forward pass")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from vitkit.inference import predict

    results = predict(args.checkpoint, args.images, top_k=args.top_k, batch_size=args.batch_size, format=args.format,
                      progress=True)  # fmt: skip
    for r in results:
        if args.json:
            print(json.dumps({"image": r.image, "top": [{"label": lab, "prob": p} for lab, p in r.top]}))
        else:
            print(r.image)
            for rank, (lab, p) in enumerate(r.top, 1):
                print(f"  {rank}. {lab:<40} {p:7.2%}")
    return 0
