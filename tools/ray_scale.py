"""The throughput model of a batch job on Ray (issue 45's scale goal), from this machine's costs, checked against a
simulated two-node cluster (``ray.cluster_utils.Cluster``): ``vitkit embed`` of the same JPEGs with a random S/16
at 224 px (``--precision auto``, batch 32) as tools/ray_overhead.py.

1. **Decode cost** ``d``: seconds of one core per image, :class:`vitkit.ray.Decode` (what a decoding task runs)
   called here on batches of 32, one PyTorch thread.
2. **Model cost** ``m``: seconds per batch of 32 of the engine an actor builds (:class:`vitkit.ray.EngineActor`,
   uint8 pixels normalised and the job's embed task), with one thread.
3. **The model**: ``img/s = min(D / d, A * 32 / m)`` for ``D`` CPUs of decoding tasks (on any nodes) and ``A``
   model actors (one thread each here; on a GPU ``m`` is the GPU's).
4. **The check**: a two-node cluster on this machine, one CPU a node, the actor (one thread) on one and the
   decoding tasks on the other: D = 1, A = 1. Its steady rate is measured from two jobs, ``--images`` and 64
   images, (N - 64) / (T_N - T_64), which takes out the fixed cost (the actor starting, the engine building).

    python tools/ray_scale.py --images 512
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--precision", default="auto")
    args = ap.parse_args()

    import torch
    from ray.cluster_utils import Cluster
    from ray_bench_setup import jpegs_and_checkpoint

    import ray
    from vitkit.data.stream import FileSource
    from vitkit.inference.embed import EmbedOptions, embed_columns, embed_job, vector_shape
    from vitkit.inference.jobs import EngineSpec
    from vitkit.ray import Decode, EngineActor, RayOptions, steps

    b = 32
    root, paths, loaded = jpegs_and_checkpoint(args.images, "vitkit-ray-scale-")
    opts = EmbedOptions(batch_size=b, precision=args.precision, progress=False)
    source = FileSource(paths)
    spec = EngineSpec.of(loaded, precision=args.precision)

    torch.set_num_threads(1)
    decode = Decode(source, dataclasses.replace(spec.transform(), uint8=True))
    chunks = [np.arange(s, min(s + b, len(paths)), dtype=np.int64).tobytes() for s in range(0, len(paths), b)]
    decoded = decode({"step": np.arange(1), "positions": np.array(chunks[:1], dtype=object)})  # warm
    start = time.perf_counter()
    decoded = decode({"step": np.arange(len(chunks)), "positions": np.array(chunks, dtype=object)})
    d = (time.perf_counter() - start) / len(paths)

    shape = vector_shape(loaded, opts)
    actor = EngineActor(spec, lambda engine, batch: embed_columns(engine, batch, opts, shape), b, threads=1)
    one = {"step": np.arange(1), "batch": decoded["batch"][:1]}
    actor(one)  # warm
    start = time.perf_counter()
    reps = 4
    for _ in range(reps):
        actor(one)
    m = (time.perf_counter() - start) / reps
    print(f"decode: {d * 1e3:.2f} ms of a core per image ({1 / d:.0f} img/s a core); model: {m:.3f} s per batch "
          f"of {b} at one thread ({b / m:.1f} img/s an actor)", flush=True)  # fmt: skip
    for D, A in ((1, 1), (4, 1), (16, 1), (16, 4), (64, 8)):
        print(f"  model: {D:3d} decoding CPUs x {A} actor(s): {min(D / d, A * b / m):8.1f} img/s "
              f"({'decode' if D / d < A * b / m else 'model'}-bound)", flush=True)  # fmt: skip

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False)
    walls = {}
    try:
        for n in (64, args.images):
            part = FileSource(paths[:n])
            start = time.perf_counter()
            embed_job(loaded, part, opts, root / f"ray{n}.npy", steps=steps(RayOptions(actors=1, threads=1)))
            walls[n] = time.perf_counter() - start
    finally:
        ray.shutdown()
        nodes.shutdown()
    rate = (args.images - 64) / (walls[args.images] - walls[64])
    predicted = min(1 / d, b / m)
    print(f"two nodes (1 CPU each; 1 actor of 1 thread, decoding on the other): {args.images} images in "
          f"{walls[args.images]:.1f} s, 64 in {walls[64]:.1f} s: steady {rate:.1f} img/s against the model's "
          f"{predicted:.1f} ({rate / predicted:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
