"""``vitkit embed``: features of images to a Parquet, .npy or .safetensors file
(:func:`vitkit.inference.embed.embed_job`). ``vitkit knn`` and ``fewshot``, which read them, are in
:mod:`vitkit.commands.evaluate`."""

from __future__ import annotations

import argparse
import sys

from vitkit.commands.args import (
    IntermixedParser,
    add_job_args,
    check_out_of_inputs,
    finish_job,
    join_processes,
    parsed,
    ray_steps,
    report_engine,
    resolve_workers,
)


def _layer(text: str) -> int:
    value = parsed(text, int, f"invalid layer {text!r} (a block number 1..L, or -1 for the last)")
    if value == 0:
        raise argparse.ArgumentTypeError("blocks count from 1 (or from the end: -1 is the last)")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="features of images (files, folders, globs or a dataset) to a .parquet, .npy or .safetensors file",
        description="Embed images with any supported checkpoint: by default its pre-logits features (the pooled "
        "token after the optional pre-logits layer, what linear probes and few-shot evaluation use), one vector per "
        "image, with the image's id, label (-1 without) and position beside it. Images are decoded as they are "
        "needed, in worker processes; each batch is written as a chunk file in OUT.parts/ and the file assembled "
        "from them at the end, so --resume continues a killed run. Under torchrun the images are shared out over "
        "the processes and process 0 writes them in input order. See docs/embeddings.md for the file layouts.",
    )
    p.__class__ = IntermixedParser  # images may follow options
    p.add_argument("checkpoint", help="checkpoint: a path, URL, registry name (vitkit models) or hub id")
    p.add_argument(
        "images", nargs="*", help="image files, folders (searched recursively) or glob patterns ('photos/**/*.jpg')"
    )
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument(
        "--data",
        help="instead of image files: a dataset as 'vitkit train' reads it ('digits', an ImageFolder root, "
        "WebDataset shards, a Hugging Face dataset, an .npz); its labels are written beside the vectors",
    )
    p.add_argument("--split", default="test", help="split of --data (default: test)")
    p.add_argument(
        "--out", required=True, metavar="FILE", help="where: FILE.parquet, FILE.npy (+ FILE.ids.json) or "
        "FILE.safetensors",
    )  # fmt: skip
    p.add_argument(
        "--pool", choices=["cls", "gap", "cls+gap", "tokens"],
        help="instead of the pre-logits features: the class token (cls), the mean of the patch tokens (gap), the two "
        "concatenated (cls+gap, DINOv2's linear-probe features) or every token (tokens, T x D per image), of the "
        "final normed tokens or of --layer's",
    )  # fmt: skip
    p.add_argument(
        "--layer", type=_layer, metavar="N",
        help="the output of transformer block N (1..L; -1 the last) before the final norm, pooled by --pool "
        "(default: the model's own pooling)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="storage type (default fp32)")
    p.add_argument("--l2", action="store_true", help="L2-normalise every vector (per token with --pool tokens)")
    add_job_args(p, backend=False)
    p.add_argument(
        "--skip-bad", action="store_true", help="a bad image: a row of NaN marked failed, counted at the end"
    )
    p.add_argument("--resume", action="store_true", help="continue the interrupted run that --out holds")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=cmd_embed)


def cmd_embed(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.stream import open_source
    from vitkit.errors import ConfigError
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.inference.jobs import check_batch_fits
    from vitkit.outputs.arrays import check_embeddings_output

    info = join_processes(args.device)  # under torchrun: this process's share of the images
    if info.is_main:  # before anything else (process 0 alone: the others would see its first chunks)
        check_embeddings_output(Path(args.out), resume=args.resume, overwrite=args.overwrite)
        check_out_of_inputs(args.out, args.images, args.data)
    if bool(args.images) == bool(args.data):
        raise ConfigError("give image files/folders/patterns or --data DATASET (one of the two)")
    source = open_source(args.images, args.data, args.split, skip_bad=args.skip_bad)
    loaded = load_checkpoint(args.checkpoint, format=args.format)
    check_batch_fits(args.batch_size, loaded.model, loaded.meta.preprocess)  # before any output is opened
    opts = EmbedOptions(
        pool=args.pool, layer=args.layer, dtype=args.dtype, l2=args.l2, batch_size=args.batch_size,
        precision=args.precision, device=args.device, workers=resolve_workers(args.workers, args.device),
        skip_bad=args.skip_bad, decode=args.decode,
    )  # fmt: skip
    summary = embed_job(
        loaded, source, opts, args.out, resume=args.resume, overwrite=args.overwrite, on_engine=report_engine,
        dist=info, steps=ray_steps(args),
    )  # fmt: skip
    if finish_job(info, summary):
        print(summary.wrote_note("embeddings", args.out), file=sys.stderr)
    return 0
