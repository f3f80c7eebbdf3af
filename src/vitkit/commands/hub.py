"""``vitkit download`` and ``vitkit models``: pretrained checkpoints by name, and the cache."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vitkit.errors import VitkitError


def add_parser(sub: argparse._SubParsersAction) -> None:
    _add_download(sub)
    _add_models(sub)


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        help="download cache (default: $VITKIT_HOME, else $XDG_CACHE_HOME/vitkit, else the platform's user cache "
        "folder, e.g. ~/.cache/vitkit); Hugging Face Hub ids use huggingface_hub's cache (HF_HOME)",
    )


def _add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="fetch checkpoints ahead of time (registry names, URLs, Hugging Face Hub ids)",
        description="Download checkpoints into the cache so that later commands (and offline machines sharing "
        "the cache) find them: a registry name (vitkit models), an http(s):// or gs:// URL, or a Hugging Face Hub "
        "id org/name[@revision]. Downloads resume after a cut connection, are checked against their sha256 and "
        "only then moved into place. Prints the local path and sha256.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="registry name, URL or hub id")
    _add_cache_dir(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from vitkit.fileio import check_output_location
    from vitkit.hub import read_record, resolve
    from vitkit.hub.cache import cache_dir

    cache = cache_dir(args.cache_dir)  # where the downloads go: refused before any request
    if cache.exists() and not cache.is_dir():
        raise VitkitError(f"{cache}: the download cache is a file, not a folder; choose another --cache-dir")
    if not cache.exists():
        check_output_location(cache)
    for name in args.names:
        found = resolve(name, cache_dir=args.cache_dir, progress=not args.quiet)
        if found.kind == "local":
            print(f"{name}: a local path already; nothing to download")
            continue
        if found.kind == "hub":
            print(f"{name}: {found.path} (Hugging Face cache)")
            continue
        rec = read_record(found.url or name, args.cache_dir)
        size = found.path.stat().st_size
        digest = f"sha256 {rec.sha256}" + (" (published)" if rec.published_sha256 else " (recorded)") if rec else ""
        print(f"{name}: {found.path} ({size / 2**20:.1f} MiB, {digest})")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the registry of Google's released ViT checkpoints",
        description="List the checkpoints vitkit knows by short name (the paper's ImageNet-21k and ImageNet "
        "fine-tuned models, the AugReg family): parameters (without the head, computed), resolution, pre-training "
        "data, fine-tuning data, ImageNet top-1 as published (with its source in --json), and whether it is "
        "already in the cache. Any of these names works wherever a checkpoint is expected.",
    )
    p.add_argument("--filter", metavar="TEXT", help="only names, architectures or datasets containing TEXT")
    _add_cache_dir(p)
    p.add_argument("--json", action="store_true", help="print the full entries as JSON")
    p.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from vitkit.hub import is_cached, search

    found = search(args.filter)
    if not found:
        print(f"no registry entry matches {args.filter!r}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    for e in found:
        rows.append({**asdict(e), "cached": is_cached(e.url, args.cache_dir)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r["name"]) for r in rows)
    head = f"{'params':>8}  {'res':>4}  {'pre-training':<13}{'fine-tuned':<12}{'top-1':>7}  cached"
    print(f"{'name':<{width}}  {'arch':<9}{head}")
    for r in rows:
        top1 = f"{r['top1']:.2f}" if r["top1"] is not None else "-"
        print(
            f"{r['name']:<{width}}  {r['architecture']:<9}{r['params_without_head'] / 1e6:>7.1f}M  "
            f"{r['resolution']:>4}  "
            f"{r['pretrain']:<13}{r['finetune'] or '-':<12}{top1:>7}  {'yes' if r['cached'] else 'no'}"
        )
    print(f"{len(rows)} models; params without the head; top-1: ImageNet-1k as published (sources: --json)")
    return 0
