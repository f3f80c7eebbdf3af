"""Feeds the table "Serving: memory under a flood of maximum-size uploads" of BENCHMARKS.md (``python
benchmarks/run_all.py serve_memory``; its "before" rows add ``--reference-src`` with an older checkout's ``src``).

Resident memory of ``vitkit serve`` under a flood of maximum-size uploads (issue 25, item 7).

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python benchmarks/serve_memory.py \
        [--clients 8 32] [--seconds 25] [--reference-src DIR] [--json out.json]

1. A random-init ViT-Ti/16 checkpoint (224 px, timm-style centre crop 0.875) and the largest upload the server's
   defaults accept: a 40-megapixel RGBA PNG (8000x5000, --max-pixels 40000000) of just under 16 MiB
   (--max-upload-mb 16): noise in the top rows, flat below. Decoded it is 160 MB (plus the decoder's copy and
   the RGB conversion).
2. ``vitkit serve`` is started as a subprocess with its defaults (--max-queue 64, fp32); this process is the
   second process: ``--clients`` threads post the PNG as fast as they are answered, each on its own keep-alive
   connection, for ``--seconds``. A sampler reads the VmRSS of the server and of its decoding worker processes
   (summed) every 20 ms, and the server's VmHWM (the kernel's peak) at the end. Statuses are counted (200, 503,
   504, other, connection errors).
3. With ``--reference-src DIR`` (the ``src`` folder of another checkout, e.g. ``git archive a66835f``) the same
   floods run against that code too, side by side. A guard kills a server whose resident memory passes
   ``--kill-above-gib`` (default 8) so the reference cannot take the machine down; the table then says so.

Reports, per source and client count: the server's resident memory when idle, its peak, the growth, the answers,
and the bound the settings imply (decoders x per-image peak + max-queue x upload).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

MAX_PIXELS = 40_000_000
MAX_UPLOAD = 16 << 20


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def tree_kib(pid: int) -> int:
    """VmRSS of ``pid`` and of its descendants (the server's image-decoding worker processes), summed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += status_kib(p, "VmRSS")
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass  # ended meanwhile
    return total


def largest_upload() -> bytes:
    """A PNG of MAX_PIXELS RGBA pixels and just under MAX_UPLOAD bytes: incompressible noise rows, then flat."""
    width, height = 8000, MAX_PIXELS // 8000
    arr = np.zeros((height, width, 4), dtype=np.uint8)  # (H, W, 4)
    arr[..., 3] = 255
    rng = np.random.default_rng(0)
    noise_rows = (MAX_UPLOAD - (1 << 20)) // (width * 4)  # ~15 MiB of noise, the rest compresses to nothing
    arr[:noise_rows] = rng.integers(0, 256, (noise_rows, width, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG", compress_level=1)
    data = buf.getvalue()
    assert len(data) <= MAX_UPLOAD, len(data)
    return data


def checkpoint(folder: Path, src: Path) -> Path:
    """A random-init ViT-Ti/16 with a timm-style centre crop, written with ``src``'s vitkit."""
    code = (
        "import sys\n"
        "from vitkit.checkpoints.preprocess import Preprocess\n"
        "from vitkit.checkpoints.vitkit_format import save\n"
        "from vitkit.models import create_model\n"
        "m = create_model('Ti/16', num_classes=10).eval()\n"
        "pre = Preprocess(image_size=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), resize='crop', "
        "crop_pct=0.875, interpolation='bicubic')\n"
        "print(save(m, sys.argv[1], preprocess=pre))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], env={**os.environ, "PYTHONPATH": str(src)},
                         check=True, capture_output=True, text=True)  # fmt: skip
    return Path(out.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client(port: int, body: bytes, deadline: float, counts: Counter[str], lock: threading.Lock) -> None:
    conn: http.client.HTTPConnection | None = None
    while time.monotonic() < deadline:
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/predict", body=body, headers={"Content-Type": "image/png"})
            r = conn.getresponse()
            r.read()
            key = str(r.status)
            if r.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as e:
            key = f"error ({type(e).__name__})"
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.05)
        with lock:
            counts[key] += 1
    if conn is not None:
        conn.close()


def flood(src: Path, ckpt: Path, body: bytes, clients: int, seconds: float, kill_above_kib: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--port", str(port), "--precision", "fp32"]
    cmd += ["--log-level", "error"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(src)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vitkit serve did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.2)
        time.sleep(1.0)
        idle = tree_kib(proc.pid)
        samples: list[int] = []
        killed = threading.Event()
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set() and proc.poll() is None:
                rss = tree_kib(proc.pid)  # the decoding workers too
                samples.append(rss)
                if rss > kill_above_kib:
                    killed.set()
                    proc.send_signal(signal.SIGKILL)
                    return
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        counts: Counter[str] = Counter()
        lock = threading.Lock()
        end = time.monotonic() + seconds
        threads = [threading.Thread(target=client, args=(port, body, end, counts, lock)) for _ in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        peak = status_kib(proc.pid, "VmHWM") if proc.poll() is None else max(samples, default=0)
        stop.set()
        sampler.join()
        alive = proc.poll() is None
        return {
            "clients": clients,
            "seconds": round(elapsed, 1),
            "idle_rss_mib": round(idle / 1024),
            "peak_rss_mib": round(max(peak, max(samples, default=0)) / 1024),
            "killed_by_guard": killed.is_set(),
            "alive_after": alive,
            "answers": dict(sorted(counts.items())),
        }
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--reference-src", type=Path, help="the src folder of another checkout to flood the same way")
    ap.add_argument("--reference-clients", type=int, nargs="+", help="client counts for the reference (default: all)")
    ap.add_argument("--kill-above-gib", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    here = Path(__file__).resolve().parents[1] / "src"
    body = largest_upload()
    print(f"upload: {len(body) / 2**20:.2f} MiB PNG, 8000x5000 RGBA = {MAX_PIXELS} pixels", file=sys.stderr)
    runs = []
    with tempfile.TemporaryDirectory(prefix="vitkit-serve-memory-") as tmp:
        ckpt = checkpoint(Path(tmp) / "ti16", here)
        sources = [("this checkout", here, args.clients)]
        if args.reference_src:
            sources.append(("reference", args.reference_src.resolve(), args.reference_clients or args.clients))
        for label, src, counts in sources:
            for n in counts:
                r = {
                    "source": label,
                    "src": str(src),
                    **flood(src, ckpt, body, n, args.seconds, int(args.kill_above_gib * 2**20)),
                }
                print(json.dumps(r), file=sys.stderr, flush=True)
                runs.append(r)
    cores = len(os.sched_getaffinity(0))
    out = {"cpu": cpu_name(), "cores": cores, "upload_bytes": len(body), "pixels": MAX_PIXELS, "runs": runs}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
