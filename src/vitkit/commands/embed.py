"""``vitkit embed`` (features of images to a Parquet, .npy or .safetensors file; :func:`vitkit.inference.embed.
embed_job`) and ``vitkit knn`` (weighted k-nearest-neighbour accuracy, the DINO protocol; :mod:`vitkit.evaluate.knn`).

kNN is a command of its own rather than an option of ``eval``: it measures a backbone, so it runs on checkpoints
without a classification head (which ``eval`` refuses), takes two splits (or two ``embed`` outputs, with no
checkpoint at all) and reports top-1/top-5 only, none of eval's per-class report.
"""

from __future__ import annotations

import argparse
import json
import sys

from vitkit.commands.args import (
    IntermixedParser,
    add_checkpoint_args,
    add_data_args,
    add_decode_arg,
    add_engine_args,
    add_workers_arg,
    join_processes,
    leave_processes,
    load_for_eval,
    positive_float,
    positive_int,
    report_engine,
    resolve_workers,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_embed(sub)
    _add_knn(sub)


def _layer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid layer {text!r} (a block number 1..L, or -1 for the last)") from None
    if value == 0:
        raise argparse.ArgumentTypeError("blocks count from 1 (or from the end: -1 is the last)")
    return value


def _add_embed(sub: argparse._SubParsersAction) -> None:
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
        "--pool", choices=["cls", "gap", "tokens"],
        help="instead of the pre-logits features: the class token (cls), the mean of the patch tokens (gap) or every "
        "token (tokens, T x D per image), of the final normed tokens or of --layer's",
    )  # fmt: skip
    p.add_argument(
        "--layer", type=_layer, metavar="N",
        help="the output of transformer block N (1..L; -1 the last) before the final norm, pooled by --pool "
        "(default: the model's own pooling)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="storage type (default fp32)")
    p.add_argument("--l2", action="store_true", help="L2-normalise every vector (per token with --pool tokens)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per forward pass (default 32)")
    add_engine_args(p, backend=False)
    add_workers_arg(p)
    add_decode_arg(p)
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
    from vitkit.fileio import printable
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.inference.vectors import check_embeddings_output

    info = join_processes(args.device)  # under torchrun: this process's share of the images
    if info.is_main:  # before anything else (process 0 alone: the others would see its first chunks)
        check_embeddings_output(Path(args.out), resume=args.resume, overwrite=args.overwrite)
    if bool(args.images) == bool(args.data):
        raise ConfigError("give image files/folders/patterns or --data DATASET (one of the two)")
    source = open_source(args.images, args.data, args.split, skip_bad=args.skip_bad)
    loaded = load_checkpoint(args.checkpoint, format=args.format)
    opts = EmbedOptions(
        pool=args.pool, layer=args.layer, dtype=args.dtype, l2=args.l2, batch_size=args.batch_size,
        precision=args.precision, device=args.device, workers=resolve_workers(args.workers, args.device),
        skip_bad=args.skip_bad, decode=args.decode,
    )  # fmt: skip
    opts.check(loaded.model.cfg.depth, loaded.model.cfg.num_prefix_tokens)
    summary = embed_job(
        loaded, source, opts, args.out, resume=args.resume, overwrite=args.overwrite, on_engine=report_engine,
        dist=info,
    )  # fmt: skip
    leave_processes(info)
    if info.is_main:
        for note in (summary.decode_note, summary.failure_note()):
            if note:
                print(f"note: {printable(note)}", file=sys.stderr)  # it names a file
        again = f" ({summary.resumed} were there already)" if summary.resumed else ""
        print(f"wrote {summary.resumed + summary.written} embeddings to {args.out}{again}", file=sys.stderr)
    return 0


def _add_knn(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "knn",
        help="weighted k-nearest-neighbour accuracy of a backbone (the DINO protocol), from a dataset or embeddings",
        description="k-nearest-neighbour classification on frozen features (DINO, Caron et al. 2021): train and "
        "test features L2-normalised, each test image's k most cosine-similar training images vote for their "
        "labels with weight exp(similarity / T), votes summed per class; top-1 and top-5 accuracy. Features are "
        "the checkpoint's pre-logits features on --data's two splits, or read from two outputs of 'vitkit embed' "
        "(--train-embeddings, --test-embeddings; any --pool/--layer, made from a labelled dataset). The search runs "
        "in blocks of --query-chunk x --bank-chunk similarities, so a bank of millions fits in memory. Under "
        "torchrun the feature extraction is shared out over the processes.",
    )
    add_checkpoint_args(p, optional=True)
    add_engine_args(p, backend=False, device=False)
    add_data_args(p, required=False)
    p.add_argument("--train-split", default="train", help="the bank's split of --data (default: train)")
    p.add_argument("--test-split", default="test", help="the split classified (default: test)")
    p.add_argument("--train-embeddings", metavar="FILE", help="the bank: an output of vitkit embed (train split)")
    p.add_argument("--test-embeddings", metavar="FILE", help="the test features: an output of vitkit embed")
    p.add_argument("-k", "--k", type=positive_int, default=20, help="neighbours that vote (default 20)")
    p.add_argument("--temperature", type=positive_float, default=0.07, help="T of the weights (default 0.07)")
    p.add_argument("--query-chunk", type=positive_int, default=256, help="test rows per block (default 256)")
    p.add_argument("--bank-chunk", type=positive_int, default=65536, help="bank rows per block (default 65536)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result to this file (an existing file needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_knn)


def check_embedding_inputs(args: argparse.Namespace) -> bool:
    """Whether a command reads features from ``--train-embeddings``/``--test-embeddings`` (both given) or computes
    them from a checkpoint and ``--data``; ConfigError for any other mix."""
    from vitkit.errors import ConfigError

    given = [args.train_embeddings is not None, args.test_embeddings is not None]
    if any(given):
        if not all(given):
            raise ConfigError("--train-embeddings and --test-embeddings go together")
        if args.data:
            raise ConfigError("give --data (with a checkpoint) or --train-embeddings/--test-embeddings, not both")
        return True
    if not args.checkpoint or not args.data:
        raise ConfigError("give a checkpoint and --data, or --train-embeddings and --test-embeddings")
    return False


def cmd_knn(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.evaluate.knn import knn_dataset, knn_embeddings
    from vitkit.fileio import check_output_file, write_file_atomic

    info = join_processes(args.device)  # under torchrun: this process's share of the images
    if args.out and info.is_main:  # refused before the work, never after it
        check_output_file(Path(args.out), overwrite=args.overwrite)
    chunks = {"k": args.k, "temperature": args.temperature, "query_chunk": args.query_chunk,
              "bank_chunk": args.bank_chunk}  # fmt: skip
    if check_embedding_inputs(args):
        report = knn_embeddings(args.train_embeddings, args.test_embeddings, **chunks)
        what = f"{args.train_embeddings} -> {args.test_embeddings}"
    else:
        from vitkit.data.base import note_skipped
        from vitkit.data.datasets import open_dataset

        loaded = load_for_eval(args)
        train = note_skipped(open_dataset(args.data, args.train_split, skip_bad=args.skip_bad))
        test = note_skipped(open_dataset(args.data, args.test_split, skip_bad=args.skip_bad))
        report = knn_dataset(
            loaded.model, train, test, loaded.meta.preprocess, batch_size=args.batch_size, device=info.device,
            workers=resolve_workers(args.workers, info.device), precision=args.precision, on_engine=report_engine,
            dist=info,
            **chunks,
        )  # fmt: skip
        what = f"{args.checkpoint} on {args.data} ({args.train_split} -> {args.test_split})"
    leave_processes(info)
    if not info.is_main:
        return 0
    doc = {"features": what, **report.to_dict()}
    if args.out:
        write_file_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{what}: kNN (k={report.k}, T={report.temperature:g}) over {report.num_train} training images")
        print(f"  top-1 {report.top1:.2%}   top-5 {report.top5:.2%}   ({report.num_test} test images)")
    return 0
