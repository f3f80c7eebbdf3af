"""``vitkit predict``: top-k labels for images -- files, folders, glob patterns or a dataset -- streamed through the
inference engine, printed or written to a JSONL/CSV/Parquet file (the job is :func:`vitkit.inference.predict.
predict_job`)."""

from __future__ import annotations

import argparse
import sys

from vitkit.commands.args import (
    IntermixedParser,
    add_job_args,
    check_out_of_inputs,
    finish_job,
    join_processes,
    positive_int,
    ray_steps,
    report_engine,
    resolve_workers,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="top-k labels for images (files, folders, globs or a dataset), printed or written to a file",
        description="Classify images with any supported checkpoint. Preprocessing (resize, mean/std) is taken from "
        "the checkpoint; labels from its class names when it has them. Images are decoded as they are needed, in "
        "worker processes, so any number of them runs in bounded memory; results are printed as they come, or "
        "written to --out (.jsonl, .csv or .parquet by its suffix, one row per image: index, image id, top-k "
        "labels, class indices and probabilities, optionally the logits), flushed per batch; --resume continues "
        "an interrupted run from what --out holds. Under torchrun the images are shared out over the processes and "
        "process 0 writes every row in input order.",
    )
    p.__class__ = IntermixedParser  # images may follow options
    p.add_argument(
        "images", nargs="*", help="image files, folders (searched recursively) or glob patterns ('photos/**/*.jpg')"
    )
    p.add_argument(
        "--checkpoint", "-c", required=True, help="checkpoint: a path, URL, registry name (vitkit models) or hub id"
    )
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument(
        "--data",
        help="instead of (or besides no) image files: a dataset as 'vitkit train' reads it ('digits', an ImageFolder "
        "root, WebDataset shards, a Hugging Face dataset, an .npz); ids are its files, shard members or rows",
    )
    p.add_argument("--split", default="test", help="split of --data (default: test)")
    p.add_argument("--top-k", type=positive_int, default=5, help="how many labels per image (default 5)")
    add_job_args(p)
    p.add_argument("--skip-bad", action="store_true", help="a bad image: a row marked failed, counted at the end")
    p.add_argument("--out", metavar="FILE", help="write rows to FILE: .jsonl, .csv or .parquet (pip install pyarrow)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run that --out holds")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--logits", action="store_true", help="with --out: also write every image's K logits")
    p.add_argument("--json", action="store_true", help="without --out: print JSON lines instead of text")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.checkpoints import load_checkpoint
    from vitkit.data.stream import open_source
    from vitkit.errors import ConfigError
    from vitkit.inference.jobs import check_batch_fits
    from vitkit.inference.predict import PredictOptions, predict_job
    from vitkit.outputs.rows import check_rows_output

    if bool(args.images) == bool(args.data):
        raise ConfigError("give image files/folders/patterns or --data DATASET (one of the two)")
    if args.out is None and (args.resume or args.logits or args.overwrite):
        raise ConfigError("--resume, --overwrite and --logits go with --out FILE")
    info = join_processes(args.device)  # under torchrun: this process's share of the images
    if args.out is not None and info.is_main:  # refused before the model is loaded
        check_rows_output(Path(args.out), resume=args.resume, overwrite=args.overwrite)
        check_out_of_inputs(args.out, args.images, args.data)
    source = open_source(args.images, args.data, args.split, skip_bad=args.skip_bad)
    loaded = load_checkpoint(args.checkpoint, format=args.format)
    check_batch_fits(args.batch_size, loaded.model, loaded.meta.preprocess)  # before any output is opened
    opts = PredictOptions(
        top_k=args.top_k,
        batch_size=args.batch_size,
        precision=args.precision,
        backend=args.backend,
        device=args.device,
        workers=resolve_workers(args.workers, args.device, args.backend),
        skip_bad=args.skip_bad,
        logits=args.logits,
        decode=args.decode,
    )

    def echo(text: str) -> None:  # rows on stdout, the progress bar on stderr: tqdm clears and redraws it around them
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()

    summary = predict_job(
        loaded, source, opts, out=args.out, resume=args.resume, overwrite=args.overwrite, as_json=args.json,
        echo=echo, on_engine=report_engine, dist=info, steps=ray_steps(args),
    )  # fmt: skip
    if finish_job(info, summary) and args.out is not None:
        print(summary.wrote_note("rows", Path(args.out)), file=sys.stderr)
    return 0
