"""Feeds the table "Serving under load" of BENCHMARKS.md (``python benchmarks/run_all.py serving``).

Bounded load test of ``vitkit serve`` on loopback, against the offline speed of the same model.

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/serve_load.py \
        [--model B/16] [--max-batch 8] [--max-wait-ms 5] [--requests 160] [--clients 16] [--json out.json]

1. Offline, in this process: the fast path (``ServedModel``, same precision as the server) timed at batch 1
   (median of 10 forwards) and at ``--max-batch`` (median of 5 forwards): the batch throughput to compare with.
2. ``vitkit serve`` started as a subprocess on 127.0.0.1 with a random-init checkpoint of ``--model``.
3. One client sends ``--single`` requests one after another (latency at 1 client), then ``--clients``
   concurrent clients send ``--requests`` requests in all (saturation), each on a keep-alive connection.
   Requests are JPEG photos (scikit-learn's china.jpg and flower.jpg, 427x640), so decoding and resizing
   are part of the served cost. Then the server gets SIGTERM.

Reports throughput at saturation as a fraction of the offline batch throughput (goal >= 0.8), p50/p99
latency at 1 client and at saturation, p50 at 1 client over one batch-1 forward (goal <= 1.5), failed
requests, and the server's resident memory before and after the load.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_image

from vitkit.checkpoints.vitkit_format import save
from vitkit.models import create_model
from vitkit.serve.served_model import ServedModel


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def offline(ckpt: Path, precision: str, batch: int) -> dict[str, float | str]:
    served = ServedModel.from_checkpoint(ckpt, precision=precision, max_batch=batch)
    C, (H, W) = served.model.cfg.in_channels, served.preprocess.image_size
    x1, xb = torch.randn(1, C, H, W), torch.randn(batch, C, H, W)
    served.warm_up(batch)

    def timed(x: torch.Tensor, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            served.probabilities(x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t1, tb = timed(x1, 10), timed(xb, 5)
    return {"precision": served.precision, "batch1_forward_s": t1, "batch_forward_s": tb, "batch_img_s": batch / tb}


def jpegs() -> list[bytes]:
    out = []
    for name in ("china.jpg", "flower.jpg"):
        buf = io.BytesIO()
        Image.fromarray(load_sample_image(name)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def client(port: int, bodies: list[bytes], n: int, offset: int, lat: list[float], fails: list[str]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for i in range(n):
        body = bodies[(offset + i) % len(bodies)]
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/predict", body=body, headers={"Content-Type": "image/jpeg"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200 or not json.loads(data)["top"]:
                fails.append(f"{r.status}: {data[:200]!r}")
        except Exception as e:  # counted, the load goes on
            fails.append(repr(e))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        lat.append(time.perf_counter() - t0)
    conn.close()


def load(port: int, bodies: list[bytes], clients: int, total: int) -> dict[str, float]:
    lat: list[float] = []
    fails: list[str] = []
    per = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    threads = [threading.Thread(target=client, args=(port, bodies, n, i, lat, fails)) for i, n in enumerate(per)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = np.percentile(lat, [50, 99])
    return {"clients": clients, "requests": total, "failed": len(fails), "wall_s": wall, "img_s": total / wall,
            "p50_s": float(q[0]), "p99_s": float(q[1]), "first_failure": fails[0] if fails else ""}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="B/16")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--single", type=int, default=30, help="requests from one client")
    ap.add_argument("--requests", type=int, default=160, help="requests at saturation, all clients together")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients at saturation")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        ckpt = save(create_model(args.model).eval(), Path(tmp) / "model")  # random init is fine for speed
        res: dict[str, object] = {"model": args.model, "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms}
        res["offline"] = off = offline(ckpt, args.precision, args.max_batch)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--port", str(port), "--log-level", "warning",
               "--precision", args.precision, "--max-batch", str(args.max_batch),
               "--max-wait-ms", str(args.max_wait_ms), "--max-queue", str(4 * args.clients)]  # fmt: skip
        server = subprocess.Popen(cmd)
        try:
            for _ in range(600):
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            bodies = jpegs()
            res["rss_before_mib"] = rss_mib(server.pid)
            res["one_client"] = one = load(port, bodies, 1, args.single)
            res["saturation"] = sat = load(port, bodies, args.clients, args.requests)
            res["rss_after_mib"] = rss_mib(server.pid)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    res["throughput_fraction"] = sat["img_s"] / float(off["batch_img_s"])  # type: ignore[arg-type]
    res["p50_1client_over_batch1_forward"] = one["p50_s"] / float(off["batch1_forward_s"])  # type: ignore[arg-type]
    res["failed"] = one["failed"] + sat["failed"]
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"\n{args.model} {off['precision']}, max-batch {args.max_batch}, max-wait {args.max_wait_ms:g} ms\n"
        f"offline: batch-1 forward {1000 * float(off['batch1_forward_s']):.1f} ms, "  # type: ignore[arg-type]
        f"batch {args.max_batch} {float(off['batch_img_s']):.2f} img/s\n"  # type: ignore[arg-type]
        f"1 client: p50 {1000 * one['p50_s']:.1f} ms, p99 {1000 * one['p99_s']:.1f} ms "
        f"({res['p50_1client_over_batch1_forward']:.2f}x one batch-1 forward)\n"
        f"{args.clients} clients: {sat['img_s']:.2f} img/s = {res['throughput_fraction']:.1%} of offline, "
        f"p50 {1000 * sat['p50_s']:.0f} ms, p99 {1000 * sat['p99_s']:.0f} ms\n"
        f"failed: {res['failed']}; server RSS {res['rss_before_mib']:.0f} -> {res['rss_after_mib']:.0f} MiB"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
