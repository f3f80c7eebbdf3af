"""A thumbnail of a large JPEG as ``vitkit serve --index`` makes it (``GET /thumbnail``), the reduced-scale path
beside the full decode it replaced, in one run:

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src python tools/thumbnails.py [--megapixels 24] [--repeat 5]

A photo (scikit-learn's ``china.jpg``) scaled to ``--megapixels`` (4:3) and saved as a quality-90 JPEG goes
through one decoding worker process (:class:`vitkit.serve.decoding.DecoderPool`) twice per repeat:

- ``full``: decoded whole, its pixels sent over the pipe, made small in this process (what ``thumbnail`` did);
- ``reduced``: ``thumbnail=256``: decoded at the smallest 1/8, 1/4 or 1/2 scale that keeps 256 px (libjpeg's
  DCT scaling), made small in the worker, only the thumbnail sent.

Prints the median wall time of each, their ratio, the bytes each sends back, and the mean absolute difference of
the two thumbnails (0-255 scale). Both thumbnails are checked to be 256 px on their long side.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_image

from vitkit.serve.decoding import DecoderPool, Decoding
from vitkit.serve.similar import THUMBNAIL_PX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megapixels", type=float, default=24.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    w = int((args.megapixels * 1e6 * 4 / 3) ** 0.5)
    h = w * 3 // 4
    buf = io.BytesIO()
    Image.fromarray(load_sample_image("china.jpg")).resize((w, h), Image.Resampling.BICUBIC).save(
        buf, "JPEG", quality=90
    )
    data = buf.getvalue()
    pool = DecoderPool(max(40_000_000, w * h), 60.0, "RGB")
    times: dict[str, list[float]] = {"full": [], "reduced": []}
    thumbs: dict[str, Image.Image] = {}
    sent = {"full": w * h * 3, "reduced": 0}
    try:
        pool.decode(data, Decoding(), THUMBNAIL_PX)  # the worker started and warm
        for _ in range(args.repeat):
            t = time.perf_counter()
            img = pool.decode(data, Decoding())
            img.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX), Image.Resampling.BICUBIC)
            times["full"].append(time.perf_counter() - t)
            thumbs["full"] = img
            t = time.perf_counter()
            thumbs["reduced"] = pool.decode(data, Decoding(), THUMBNAIL_PX)
            times["reduced"].append(time.perf_counter() - t)
    finally:
        pool.close()
    sent["reduced"] = len(thumbs["reduced"].tobytes())
    for name, img in thumbs.items():
        assert max(img.size) == THUMBNAIL_PX, (name, img.size)
    diff = np.abs(np.asarray(thumbs["full"], np.float32) - np.asarray(thumbs["reduced"], np.float32)).mean()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"JPEG {w}x{h} ({len(data) / 1e6:.1f} MB), median of {args.repeat}:")
    for k in ("full", "reduced"):
        print(f"  {k:8s} {1000 * med[k]:8.1f} ms   {sent[k] / 1e6:8.2f} MB over the pipe")
    print(f"  reduced / full: {med['reduced'] / med['full']:.3f}x the time; thumbnails differ by {diff:.2f}/255 mean")


if __name__ == "__main__":
    main()
