"""``vitkit index``, ``vitkit search`` and ``vitkit dedup``: similarity search over embeddings
(:mod:`vitkit.search`)."""

from __future__ import annotations

import argparse
import sys

from vitkit.commands.args import (
    IntermixedParser,
    add_engine_args,
    add_ray_args,
    add_workers_arg,
    parsed,
    positive_int,
    print_notes,
    ray_steps,
    report_engine,
    resolve_workers,
)
from vitkit.textids import printable


def _cosine(text: str) -> float:
    value = parsed(text, float, f"invalid cosine similarity {text!r} (a number in -1..1)")
    if not -1.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: a cosine similarity is in -1..1")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="build a similarity-search index from embed's output or from images (-c), or --add / --remove in one",
        description="Build a vitkit index (a folder: manifest with checksums, ids, normalised float32 vectors, and "
        "for --backend hnsw the graph) from an output of 'vitkit embed' or from images/a dataset embedded with -c "
        "on the way. 'vitkit index --add SOURCE INDEX' appends (ids already there are skipped, so a rerun after a "
        "kill completes it), 'vitkit index --remove IDS INDEX' drops ids (IDS: a file of ids, one a line, or "
        "id:ID). The index is replaced only once the new one is complete. See docs/search.md.",
    )
    p.__class__ = IntermixedParser
    p.add_argument("inputs", nargs="*", metavar="SOURCE", help="an embed output, or images/folders/patterns (-c)")
    p.add_argument("--out", metavar="INDEX", help="the index folder to build")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--add", action="store_true", help="SOURCE... INDEX: append SOURCE's vectors to INDEX")
    what.add_argument("--remove", metavar="IDS", help="IDS INDEX: drop these ids (a file, one a line, or id:ID)")
    p.add_argument("-c", "--checkpoint", help="embed SOURCE's images with this checkpoint on the way")
    p.add_argument("--data", help="instead of image files: a dataset as 'vitkit embed --data' reads it")
    p.add_argument("--split", default="test", help="split of --data (default: test)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--exact", action="store_true", help="exact search only (the default)")
    kind.add_argument("--backend", choices=["exact", "hnsw", "ivf"],
                      help="approximate: ivf (k-means lists, no extra needed; large collections) or hnsw (a graph, "
                      "vitkit[search])")  # fmt: skip
    p.add_argument("--pool", choices=["cls", "gap", "cls+gap"], help="with -c: as 'vitkit embed --pool'")
    p.add_argument("--layer", type=int, metavar="N", help="with -c: as 'vitkit embed --layer'")
    p.add_argument("--batch-size", type=positive_int, default=32, help="with -c: images per forward pass")
    add_engine_args(p, backend=False)
    add_workers_arg(p)
    p.add_argument("--skip-bad", action="store_true", help="with -c: leave out images that do not decode")
    p.add_argument("--overwrite", action="store_true", help="replace an existing index at --out")
    add_ray_args(p)  # with -c: the embedding on the way as 'vitkit embed --ray' runs it
    p.set_defaults(func=cmd_index)

    p = sub.add_parser(
        "search",
        help="the nearest images of queries (images, a folder, id:ID, --vectors) in an index",
        description="Search an index: each query's --top-k neighbours with cosine scores, as a table on stdout or "
        "--out FILE.jsonl (rows {query, neighbours: [{id, score}]}) or .csv. Image queries are embedded with the "
        "index's checkpoint (recorded when it was built with -c, else -c) and options; a checkpoint or --vectors "
        "file made otherwise than the index is refused.",
    )
    p.__class__ = IntermixedParser
    p.add_argument("index", metavar="INDEX", help="an index folder (vitkit index)")
    p.add_argument("queries", nargs="*", metavar="QUERY", help="image files, folders, patterns, or id:ID")
    p.add_argument("--vectors", metavar="FILE", help="query vectors: an output of vitkit embed")
    p.add_argument("--top-k", type=positive_int, default=10, help="neighbours per query (default 10)")
    p.add_argument("-c", "--checkpoint", help="the checkpoint to embed image queries with (default: the index's)")
    p.add_argument("--device", default="cpu", help="where image queries are embedded (default cpu)")
    p.add_argument("--out", metavar="FILE", help="FILE.jsonl or FILE.csv (default: a table on stdout)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "dedup",
        help="groups of near-duplicate images in an index, as CSV, with a plot of the score distribution",
        description="Near-duplicate groups: connected components of the neighbour graph (each image's --k nearest, "
        "an edge at cosine >= --threshold). Writes --out groups.csv (group, image, score: the representative first, "
        "each member's cosine to it) and beside it groups.scores.png, the histogram of every image's best "
        "neighbour score with the threshold marked, to choose the threshold by.",
    )
    p.add_argument("index", metavar="INDEX", help="an index folder (vitkit index)")
    p.add_argument("--threshold", type=_cosine, default=None, help="cosine similarity (default 0.95)")
    p.add_argument("--k", type=positive_int, default=10, help="neighbours per image in the graph (default 10)")
    p.add_argument("--out", required=True, metavar="FILE.csv", help="where the groups go")
    p.add_argument("--plot", metavar="FILE.png", help="the histogram (default: beside --out, .scores.png)")
    p.set_defaults(func=cmd_dedup)


def cmd_index(args: argparse.Namespace) -> int:
    from vitkit.errors import ConfigError
    from vitkit.search import operations

    workers = resolve_workers(args.workers, args.device)
    settings = operations.EmbedSettings(pool=args.pool, layer=args.layer, precision=args.precision,
                                  batch_size=args.batch_size, device=args.device, workers=workers,
                                  skip_bad=args.skip_bad, steps=ray_steps(args))  # fmt: skip
    if args.ray is not None and not args.checkpoint:
        raise ConfigError("--ray: only with -c (it runs the embedding of images on the way, as embed --ray)")
    notes: list[str] = []
    if args.add or args.remove:
        if args.out:
            raise ConfigError("--out is for a new index; --add and --remove change INDEX in place")
        if not args.inputs:
            raise ConfigError("name the INDEX to change (the last argument)")
        *source, index_path = args.inputs
        if args.remove:
            if source:
                raise ConfigError("--remove IDS INDEX takes no SOURCE")
            index, removed = operations.remove_from_index(operations.read_ids_arg(args.remove), index_path)
            print(f"removed {removed} id(s) from {printable(index_path)}; {len(index)} left", file=sys.stderr)
            return 0
        if not source and not args.data:
            raise ConfigError("--add SOURCE INDEX: name what to add")
        index, added = operations.add_to_index(source, index_path, checkpoint=args.checkpoint, data=args.data,
                                         split=args.split, settings=settings, notes=notes,
                                         on_engine=report_engine)  # fmt: skip
        print_notes(notes, names_files=True)
        print(f"added {added} vector(s) to {printable(index_path)}; {len(index)} in all", file=sys.stderr)
        return 0
    if not args.out:
        raise ConfigError("give --out INDEX (or --add / --remove an existing one)")
    if not args.inputs and not args.data:
        raise ConfigError("give SOURCE: an output of vitkit embed, or images with -c")
    backend = args.backend or "exact"  # the default, and --exact's (mutually exclusive with --backend)
    index = operations.build_index(args.inputs, args.out, checkpoint=args.checkpoint, data=args.data, split=args.split,
                             backend=backend, overwrite=args.overwrite, settings=settings, notes=notes,
                             on_engine=report_engine)  # fmt: skip
    print_notes(notes, names_files=True)
    print(f"indexed {len(index)} vectors ({backend}) in {printable(args.out)}", file=sys.stderr)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from vitkit.search import Index, operations

    index = Index.open(args.index)
    settings = operations.settings_of(index)
    settings.device = args.device
    q = operations.query_vectors(
        index, args.queries, vectors=args.vectors, checkpoint=args.checkpoint, settings=settings
    )
    rows = operations.search_index(index, q, args.top_k)
    if args.out:
        operations.write_results(rows, args.out)
        print(f"wrote the neighbours of {len(rows)} queries to {printable(args.out)}", file=sys.stderr)
    else:
        for line in operations.results_table(rows):
            print(printable(line))
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitkit.search import Index, operations
    from vitkit.search.dedup import DEFAULT_THRESHOLD, find_groups, plot_scores

    index = Index.open(args.index)
    found = find_groups(index, DEFAULT_THRESHOLD if args.threshold is None else args.threshold, args.k)
    operations.write_groups(index, found, args.out)
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_name(out.stem + ".scores.png")
    plot_scores(found, plot)
    images = sum(len(g) for g in found.groups)
    print(f"{len(found.groups)} group(s) of near-duplicates ({images} images) at cosine >= {found.threshold:g}: "
          f"{printable(args.out)}; score distribution: {printable(str(plot))}", file=sys.stderr)  # fmt: skip
    return 0
