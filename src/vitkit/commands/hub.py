"""``vitkit download`` and ``vitkit models``: pretrained checkpoints by name, and the cache."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vitkit.errors import VitkitError
from vitkit.hub.families import FAMILIES


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
    from vitkit.hub import read_record, resolve
    from vitkit.hub.cache import cache_dir
    from vitkit.output_paths import check_output_location

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
        help="list the registry of released ViT checkpoints (Google's, DINOv2, SigLIP, CLIP, DeiT)",
        description="List the checkpoints vitkit knows by name: Google's (the paper's ImageNet-21k and ImageNet "
        "fine-tuned models, the AugReg family) with parameters (without the head, computed), resolution, "
        "pre-training data, fine-tuning data and ImageNet top-1 as published (with its source in --json); and the "
        "modern families' Hugging Face Hub ids and timm names with architecture, parameters (computed), "
        "resolution, default embedding and format; and whether each is already in the cache. Any of these names "
        "works wherever a checkpoint is expected.",
    )
    p.add_argument("--filter", metavar="TEXT", help="only names, architectures or datasets containing TEXT")
    p.add_argument(
        "--family",
        choices=("paper", "augreg", *FAMILIES),
        help="only this family: Google's (paper, augreg) or a modern one (dinov2, dinov3, eva02, siglip, clip, deit: "
        "Hugging Face Hub ids and timm names, listed with their default embedding and format)",
    )
    _add_cache_dir(p)
    p.add_argument("--json", action="store_true", help="print the full entries as JSON")
    p.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from vitkit.hub import families as fam
    from vitkit.hub import is_cached, search
    from vitkit.hub.resolve import is_hub_cached

    modern = args.family in FAMILIES
    found = [] if modern else [e for e in search(args.filter) if args.family in (None, e.family)]
    listed = [] if args.family in ("paper", "augreg") else fam.search(args.filter, args.family)
    if not found and not listed:
        print(f"no registry entry matches {args.filter!r}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = [{**asdict(e), "cached": is_cached(e.url, args.cache_dir)} for e in found]
    family_rows = [{**asdict(e), "cached": is_hub_cached(e.repo_id)} for e in listed]
    if args.json:
        print(json.dumps(rows + family_rows, indent=1))
        return 0
    if rows:
        _print_google(rows)
    if family_rows:
        if rows:
            print()
        _print_families(family_rows)
    return 0


def _print_google(rows: list[dict[str, Any]]) -> None:
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


def _print_families(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["name"]) for r in rows)
    print(
        f"{'name':<{width}}  {'family':<7}{'arch':<14}{'params':>8}  {'res':>4}  {'format':<9}{'embedding':<21}cached"
    )
    for r in rows:
        params = f"{r['params'] / 1e6:>7.1f}M" if not r["refused"] else f"{'-':>8}"
        embedding = "refused" if r["refused"] else r["embedding"].split(" (")[0].split(";")[0]
        print(
            f"{r['name']:<{width}}  {r['family']:<7}{r['architecture']:<14}{params}  {r['resolution'] or '-':>4}  "
            f"{r['format']:<9}{embedding:<21}{'yes' if r['cached'] else 'no'}"
        )
    refused = sum(1 for r in rows if r["refused"])
    print(
        f"{len(rows)} family checkpoints ({refused} refused: --json says why); params: vitkit's model as loaded; "
        "names: the Hub id or the timm name"
    )
