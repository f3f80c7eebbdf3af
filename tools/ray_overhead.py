"""The Ray path's images per second against the local job's, side by side in one run, on this machine
(issue 45's overhead goal): ``vitkit embed`` of the same JPEGs with a random S/16 at 224 px, ``--precision auto``,
locally (the default decoding workers) and with ``--ray`` on a local cluster of ``--cpus`` CPUs (one model
actor holding one of them, decoding tasks the rest). The cluster is started before the clock; the Ray time
includes its actor starting and building the engine, as the local time includes building it. (Not a table of
BENCHMARKS.md, which is at its length limit; the numbers are in docs/ray.md.)

    python tools/ray_overhead.py --images 512 --cpus 2
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from ray_bench_setup import jpegs_and_checkpoint

    import ray
    from vitkit.data.stream import FileSource
    from vitkit.inference.embed import EmbedOptions, embed_job
    from vitkit.ray import RayOptions, steps

    root, paths, loaded = jpegs_and_checkpoint(args.images, "vitkit-ray-bench-")
    opts = EmbedOptions(batch_size=32, precision=args.precision, workers=1, progress=False)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    for r in range(args.rounds):
        for name, on_ray in (("local", None), ("ray", RayOptions(actors=1))):
            out = root / f"{name}{r}.npy"
            start = time.perf_counter()
            summary = embed_job(loaded, FileSource(paths), opts, out, steps=None if on_ray is None else steps(on_ray))
            wall = time.perf_counter() - start
            print(f"round {r} {name:5s}: {args.images / wall:7.1f} img/s ({wall:.1f} s; engine {summary.engine})",
                  flush=True)  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
