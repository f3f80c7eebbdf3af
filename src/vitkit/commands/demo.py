"""``vitkit demo CKPT``: a web page (Gradio) with predictions, attention rollout and the model's figures."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from vitkit.commands.serve import add_model_options, open_served, require_extra


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="web page: upload an image, see the top-5, attention rollout, per-layer/head attention, model figures",
        description="Open a Gradio page for a checkpoint: upload, paste or pick a sample image; the top-5 classes "
        "as bars, the attention rollout overlaid on the image, one layer's raw attention per head (layer and head "
        "selectors), and the model's position-embedding similarity and patch-embedding filter figures; with "
        "--index, a 'Similar images' tab. Needs: pip install 'vitkit[demo]'.",
    )
    add_model_options(p)
    p.add_argument("--port", type=int, default=7860, help="TCP port (default 7860)")
    p.add_argument("--samples", nargs="*", default=[], metavar="IMAGE", help="more sample images to offer")
    p.add_argument(
        "--index",
        metavar="INDEX",
        help="a vitkit index (vitkit index) made with this checkpoint: adds a 'Similar images' tab (an upload or an "
        "indexed id -> its nearest indexed images as thumbnails, with ids and scores)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    require_extra("gradio", extra="demo")
    from vitkit.images import load_image
    from vitkit.serve.demo import build_demo, launch
    from vitkit.serve.net import check_free

    check_free(args.host, args.port)  # a bad or taken port is one line here, before the model loads or any banner
    samples = [Path(s) for s in args.samples]
    for s in samples:
        load_image(s)  # a bad sample is an error naming it, before the page starts
    served, similar = open_served(args, precision="fp32", fast=False)
    with tempfile.TemporaryDirectory(prefix="vitkit-demo-") as work:
        demo = build_demo(served, Path(work), samples, similar)
        print(f"vitkit demo: {served.card()['name']} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        launch(demo, args.host, args.port, [work, *{str(s.resolve().parent) for s in samples}])
    return 0
