"""Feeds the table "Similarity search: exact against approximate (HNSW) libraries" of BENCHMARKS.md (``python
benchmarks/run_all.py search``).

Which approximate-nearest-neighbour structure backs ``vitkit index --backend`` (issue 44): faiss-cpu's
``IndexHNSWFlat``, hnswlib and usearch, each an HNSW graph with the same connectivity (``--M``, 16) and build effort
(``--ef-construction``, 100), and vitkit's own inverted file (``ivf``: k-means lists probed with exact products,
:class:`vitkit.search.ann.Lists`, ``--nprobe`` lists per query), measured against vitkit's exact search (blocked
float32 matrix products, the ground truth).

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/search_ann.py \
        [--n 200000] [--dim 384] [--libs exact faiss hnswlib usearch ivf] [--ef 32 64 128] [--nprobe 4 8 16] \
        [--M 16] [--ef-construction 100] [--json out.json]

The vectors: a mixture of von Mises-Fisher-like clusters on the unit sphere (``--clusters`` centres uniform on
S^(d-1), cluster weights from a Dirichlet(1) draw, each point the normalised centre + Gaussian noise of per-axis
sigma ``--spread``/sqrt(d)). Uniform random vectors in 384 dimensions have no neighbour structure (every point is
almost equally far from all others, cosine ~ N(0, 1/d)), which makes recall@10 meaningless; image embeddings are
clustered by content (classes, near-duplicates), with nearest-neighbour cosines well above the background. The
default spread 1.0 puts a point's cosine to its centre near 0.7 and to a cluster-mate near 0.5, the range of
ViT features of images of one class. Queries are 1,000 further draws from the same mixture. The set is a mixture
of exactly ``--clusters`` blobs, which suits a k-means partition (ivf's sqrt(n) lists are ~1,000 at 1M): real
features form a less crisp hierarchy, so check recall on your own vectors (``vitkit index --backend ivf`` then
``Index.search_rows(q, k, exact=True)`` for the truth).

Per library: build time (``--threads`` threads), the index's memory (the library's saved file, and the growth of
this process's resident memory during the build), recall@10 against exact top-10 for each efSearch, batch queries
per second (all queries at once, ``--threads`` threads) and single-query latency (one query per call, one thread,
p50 and p99 over the queries).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

K = 10
M = 16  # --M
EF_CONSTRUCTION = 100  # --ef-construction


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def clustered(n: int, dim: int, clusters: int, spread: float, seed: int) -> np.ndarray:
    """``n`` unit vectors from a mixture of ``clusters`` Gaussian blobs projected onto the sphere."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = rng.dirichlet(np.ones(clusters))
    which = rng.choice(clusters, size=n, p=weights)
    out = np.empty((n, dim), dtype=np.float32)
    for s in range(0, n, 65536):
        w = which[s : s + 65536]
        x = centres[w] + rng.standard_normal((len(w), dim)).astype(np.float32) * (spread / np.sqrt(dim))
        out[s : s + len(w)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def exact_topk(data: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    from vitkit.search.exact import exact_search

    return exact_search(data, queries, k)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(set(map(int, f)) & set(map(int, t))) for f, t in zip(found, truth, strict=True))
    return hits / truth.size


def timed_single(one: Callable[[np.ndarray], Any], queries: np.ndarray) -> tuple[float, float]:
    lat = []
    for q in queries:
        t = time.perf_counter()
        one(q)
        lat.append(time.perf_counter() - t)
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_exact(data: np.ndarray, queries: np.ndarray, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    t = time.perf_counter()
    exact_topk(data, queries, K)
    qps = len(queries) / (time.perf_counter() - t)
    torch.set_num_threads(1)
    p50, p99 = timed_single(lambda q: exact_topk(data, q[None], K), queries[:100])
    torch.set_num_threads(threads)
    return {"build_s": 0.0, "index_bytes": data.nbytes, "rows": [{"ef": None, "recall": 1.0, "qps": qps,
            "p50_ms": p50, "p99_ms": p99}]}  # fmt: skip


def run_lib(name: str, data: np.ndarray, queries: np.ndarray, truth: np.ndarray, efs: list[int], threads: int,
            tmp: Path) -> dict[str, Any]:  # fmt: skip
    n, dim = data.shape
    labels = np.arange(n, dtype=np.int64)
    before = rss_bytes()
    t0 = time.perf_counter()
    if name == "faiss":
        import faiss

        faiss.omp_set_num_threads(threads)
        index = faiss.IndexHNSWFlat(dim, M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = EF_CONSTRUCTION
        index.add(data)
        build = time.perf_counter() - t0
        faiss.write_index(index, str(tmp / "f.index"))
        size = (tmp / "f.index").stat().st_size

        def set_ef(ef: int) -> None:
            index.hnsw.efSearch = ef

        def batch(q: np.ndarray) -> np.ndarray:
            return index.search(q, K)[1]

        def one(q: np.ndarray) -> Any:
            return index.search(q[None], K)

        def threads_to(t: int) -> None:
            faiss.omp_set_num_threads(t)
    elif name == "hnswlib":
        import hnswlib

        index = hnswlib.Index(space="ip", dim=dim)
        index.init_index(max_elements=n, ef_construction=EF_CONSTRUCTION, M=M, random_seed=0)
        index.set_num_threads(threads)
        index.add_items(data, labels)
        build = time.perf_counter() - t0
        index.save_index(str(tmp / "h.bin"))
        size = (tmp / "h.bin").stat().st_size

        def set_ef(ef: int) -> None:
            index.set_ef(ef)

        def batch(q: np.ndarray) -> np.ndarray:
            return index.knn_query(q, k=K)[0]

        def one(q: np.ndarray) -> Any:
            return index.knn_query(q[None], k=K)

        def threads_to(t: int) -> None:
            index.set_num_threads(t)
    elif name == "usearch":
        from usearch.index import Index

        index = Index(ndim=dim, metric="ip", dtype="f32", connectivity=M, expansion_add=EF_CONSTRUCTION)
        index.add(labels, data, threads=threads)
        build = time.perf_counter() - t0
        index.save(str(tmp / "u.usearch"))
        size = (tmp / "u.usearch").stat().st_size
        state = {"threads": threads}

        def set_ef(ef: int) -> None:
            index.expansion_search = ef

        def batch(q: np.ndarray) -> np.ndarray:
            return index.search(q, K, threads=state["threads"]).keys

        def one(q: np.ndarray) -> Any:
            return index.search(q, K, threads=1)

        def threads_to(t: int) -> None:
            state["threads"] = t
    elif name == "ivf":
        from vitkit.search.ann import Lists, ivf_params

        index = Lists.build(data, ivf_params(n))
        build = time.perf_counter() - t0
        index.save(tmp / "l.ivf")
        size = (tmp / "l.ivf").stat().st_size

        def set_ef(ef: int) -> None:
            index.nprobe = ef

        def batch(q: np.ndarray) -> np.ndarray:
            return index.search(q, K)

        def one(q: np.ndarray) -> Any:
            return index.search(q[None], K)

        def threads_to(t: int) -> None:
            import torch

            torch.set_num_threads(t)
    else:
        raise SystemExit(f"unknown library {name}")
    grown = rss_bytes() - before
    rows = []
    for ef in efs:
        set_ef(ef)
        threads_to(threads)
        t = time.perf_counter()
        found = batch(queries)
        qps = len(queries) / (time.perf_counter() - t)
        threads_to(1)
        p50, p99 = timed_single(one, queries)
        rows.append({"ef": ef, "recall": recall(np.asarray(found), truth), "qps": qps, "p50_ms": p50, "p99_ms": p99})
        print(f"{name} ef={ef}: {rows[-1]}", file=sys.stderr)
    return {"build_s": build, "index_bytes": size, "rss_growth_bytes": grown, "rows": rows}


def main() -> None:
    global M, EF_CONSTRUCTION
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--spread", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--libs", nargs="+", default=["exact", "faiss", "hnswlib", "usearch", "ivf"])
    ap.add_argument("--ef", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--nprobe", nargs="+", type=int, default=[4, 8, 16], help="lists probed (ivf)")
    ap.add_argument("--M", type=int, default=M)
    ap.add_argument("--ef-construction", type=int, default=EF_CONSTRUCTION)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    M, EF_CONSTRUCTION = args.M, args.ef_construction
    import torch

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    both = clustered(args.n + args.queries, args.dim, args.clusters, args.spread, seed=0)
    data, queries = np.ascontiguousarray(both[: args.n]), np.ascontiguousarray(both[args.n :])
    print(f"data {data.shape} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    truth_s, truth = exact_topk(data, queries, K)
    print(f"exact truth in {time.perf_counter() - t:.1f} s; mean top-1 cosine {truth_s[:, 0].mean():.3f}, "
          f"10th {truth_s[:, -1].mean():.3f}", file=sys.stderr)  # fmt: skip
    record: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "n": args.n, "dim": args.dim,
        "queries": args.queries, "clusters": args.clusters, "spread": args.spread, "threads": args.threads,
        "M": M, "ef_construction": EF_CONSTRUCTION, "raw_bytes": data.nbytes,
        "top1_cosine": float(truth_s[:, 0].mean()), "top10_cosine": float(truth_s[:, -1].mean()), "libs": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        for name in args.libs:
            if name == "exact":
                record["libs"][name] = run_exact(data, queries, args.threads)
            else:
                efs = args.nprobe if name == "ivf" else args.ef
                record["libs"][name] = run_lib(name, data, queries, truth, efs, args.threads, Path(d))
            print(json.dumps({name: record["libs"][name]}), file=sys.stderr)
    print(json.dumps(record, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
