"""Are engines and torch fairly timed in one process? The same runners timed (a) alternating in one process
with vitkit bench's settle pause, (b) alternating with no pause, and (c) each alone in its own process, the
processes interleaved. Also the CPU time each runner's thread pool burns while idle right after a call.

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/engine_fairness.py S/16

Needs vitkit[bench]. Prints one JSON document.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from vitkit.bench.engines import SETTLE_S
from vitkit.bench.harness import BenchSpec, build_model
from vitkit.inference import optimize_for_inference
from vitkit.inference.backends import engine_model, export_for_engines
from vitkit.timing import time_alternating

RUNNERS = ("vitkit-fast bf16", "openvino bf16", "vitkit-fast int8", "onnxruntime int8")
BATCH, REPEATS = 32, 5


def build(name: str, model: torch.nn.Module, onnx_dir: str) -> torch.nn.Module:
    impl, precision = name.split()
    if impl == "vitkit-fast":
        return optimize_for_inference(model, torch.bfloat16, int8=precision == "int8", batch_size=BATCH)
    return engine_model(export_for_engines(model, onnx_dir), impl, precision)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(variant: str, name: str) -> None:
    model, _ = build_model(BenchSpec(model=variant))
    x = torch.randn(BATCH, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        fn = build(name, model, tmp)
    with torch.no_grad():
        fn(x)
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
    print(json.dumps(BATCH / statistics.median(times)))


def main(variant: str) -> None:
    model, _ = build_model(BenchSpec(model=variant))
    x = torch.randn(BATCH, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        fns = {n: build(n, model, tmp) for n in RUNNERS}
    steps = {n: (lambda fn=fn: fn(x)) for n, fn in fns.items()}
    spin: dict[str, list[float]] = {n: [] for n in RUNNERS}
    with torch.no_grad():
        for step in steps.values():
            step()
        for _ in range(2):  # CPU burnt by the pools in 200 ms of idling after a call
            for n, step in steps.items():
                step()
                c0 = cpu_s()
                time.sleep(0.2)
                spin[n].append(1e3 * (cpu_s() - c0))
        cpu = torch.device("cpu")
        settled = time_alternating(steps, REPEATS, cpu, torch.get_num_threads(), SETTLE_S)
        back_to_back = time_alternating(steps, REPEATS, cpu, torch.get_num_threads(), 0.0)
    alone: dict[str, list[float]] = {n: [] for n in RUNNERS}
    for _ in range(2):  # each runner alone in a fresh process, the processes interleaved
        for n in RUNNERS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, n], capture_output=True, text=True, check=True
            )
            alone[n].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {
        "model": variant,
        "batch": BATCH,
        "settle_s": SETTLE_S,
        "spin_cpu_ms_after_call": spin,
        "img_per_s": {
            n: {
                "in_process_settled": BATCH / settled[n].median,
                "in_process_back_to_back": BATCH / back_to_back[n].median,
                "alone_in_own_process": alone[n],
                "cpu_util_settled": settled[n].cpu_util,
            }
            for n in RUNNERS
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "S/16")
