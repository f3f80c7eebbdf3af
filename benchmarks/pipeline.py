"""Feeds the table "Batch jobs' input pipeline: main-process CPU per image, workers against raw decoding" of
BENCHMARKS.md (``python benchmarks/run_all.py pipeline``).

The path of ``vitkit predict`` and ``vitkit eval`` with the model replaced by a no-op (a module returning zero
logits), over an ImageFolder of photo JPEGs of about 500 x 375 (``--images``, default 2,048: crops of
scikit-learn's two sample photos, as ``batch_inference.py`` makes them), batch ``--batch-size`` (256). It
reports:

- **main-process CPU per image**: the CPU time of the job's main thread (``time.thread_time()``, where the
  job's loop, the engine's feed and the sink run) over the job, for ``--images`` and a quarter of them, the
  difference divided by the difference in images (fixed costs cancel); beside it the same of the whole process
  (``time.process_time()``, every thread), which earlier versions of this table reported and which counts the
  CPU that PyTorch's OpenMP threads spend spinning between parallel regions (it moved 24-72 us/image between
  runs of one job). Both for ``predict --out x.jsonl``, ``predict --out x.parquet`` and ``eval`` (its logits
  collected), on the path of a job whose engine is on a GPU (uint8 batches; the GPU's normalisation is left out
  with the model), and ``eval-cpu``, the path on a CPU device (float batches, normalised by the workers); and
  ``pin copy``, a copy of a uint8 batch into another buffer (both already in memory) per image, the least
  that ``pin_memory`` costs the pinning thread on a GPU machine (there is no CUDA to pin with here);
- **each worker against raw decoding**: one process decoding the same files with simplejpeg, alone (the call
  and scale the transform uses, and the issue's ``min_height/min_width=224``), against the transform alone in
  one process and against a one-worker job (images / wall time, the main process consuming);
- **scaling**: the ``eval`` job's images per second of wall time with 1 .. ``--max-workers`` workers (over the
  difference of the two folders, so start-up is left out).

The engine is built in bf16 (whatever the CPU: the model is replaced), so that no start-up timing (``auto``
times a GEMM) adds noise to the differences, and before the job is timed: its build (packing weights) is a fixed
cost that varied by tens of milliseconds between runs, tens of us/image in the difference. The no-op goes in
through the engine's documented seam (:class:`vitkit.inference.engine.InferenceEngine`): the script builds the
engine, puts the no-op in the model's place (``runner``) and hands the job ``EngineSpec.of_engine(engine)``; the GPU
path is taken with a plan whose ``feeds_gpu`` says True. A version before the seam (``--baseline``) is patched
where it builds its engine instead, its build's CPU left out. The no-op counts what it is given, and a job in
which it did not see every image, or on the GPU path saw floats instead of uint8 pixels, gives no figure (exit 1:
the real model ran, or the CPU path).

``--baseline REV`` measures the ``src/`` of git revision REV the same way in the same run (each measurement
its own process, with that ``src/`` first on the path; the old code's workers hand over float batches). Run it
under the machine's lock::

    flock /tmp/vitkit-cpu.lock python benchmarks/pipeline.py --baseline 78bcf52 --json /tmp/pipeline.json

``--json FILE`` writes the results; the photos go to a temporary folder (``--work`` keeps them).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("predict-jsonl", "predict-parquet", "eval", "eval-cpu")


# ---- the driver -------------------------------------------------------------------------------------------


def cpu_name() -> str:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def prepare(work: Path, images: int) -> tuple[Path, Path, Path]:
    """The photo folders (all images, and the first quarter as hard links) and a near-free checkpoint (patch 32,
    width 32, depth 1, 10 classes: its forward is replaced anyway)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "src"))
    import batch_inference as bi

    big, small = work / "photos", work / "photos-small"
    if not big.exists():
        bi.make_photos(big, images)
    if not small.exists():
        files = sorted(big.glob("test/*/*.jpg"))
        for f in files[: len(files) // 4]:
            (small / "test" / f.parent.name).mkdir(parents=True, exist_ok=True)
            os.link(f, small / "test" / f.parent.name / f.name)
    ckpt = work / "tiny"
    if not ckpt.exists():
        import vitkit
        from vitkit.models.vit import VisionTransformer, ViTConfig

        cfg = ViTConfig(patch_size=32, hidden_size=32, depth=1, num_heads=1, mlp_dim=64, num_classes=10)
        vitkit.save_pretrained(VisionTransformer(cfg).eval(), ckpt, class_names=bi.CLASSES)
    return big, small, ckpt


def run_child(src: Path, *argv: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"child {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(src: Path, big: Path, small: Path, ckpt: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every mode at 1 worker, and ``eval`` at 2 .. max workers, each over both folders ``--rounds`` times:
    per image, main-process CPU and wall time over the difference of the two folders (medians)."""
    res: dict[str, Any] = {"main_us_per_image": {}, "process_us_per_image": {}, "scaling_img_s": {}}
    n_big, n_small = len(list(big.glob("test/*/*.jpg"))), len(list(small.glob("test/*/*.jpg")))
    runs = [(mode, 1) for mode in MODES] + [("eval", w) for w in range(2, args.max_workers + 1)]
    for mode, w in runs:
        main, cpu, rate = [], [], []
        for _ in range(args.rounds):
            r = {size: run_child(src, "job", mode, str(folder), str(ckpt), str(args.batch_size), str(w))
                 for size, folder in (("big", big), ("small", small))}  # fmt: skip
            if r["big"].get("skipped"):
                break
            main.append((r["big"]["main_thread_s"] - r["small"]["main_thread_s"]) / (n_big - n_small) * 1e6)
            cpu.append((r["big"]["cpu_s"] - r["small"]["cpu_s"]) / (n_big - n_small) * 1e6)
            rate.append((n_big - n_small) / (r["big"]["wall_s"] - r["small"]["wall_s"]))
        if not cpu:
            continue
        if w == 1:
            res["main_us_per_image"][mode] = median(main)
            res["process_us_per_image"][mode] = median(cpu)
            print(f"  {mode:16s} main thread {median(main):7.1f} us/image {[round(c, 1) for c in main]}; "
                  f"whole process {median(cpu):7.1f} {[round(c, 1) for c in cpu]}", flush=True)  # fmt: skip
        if mode == "eval":
            res["scaling_img_s"][str(w)] = median(rate)
            print(f"  eval, {w} worker(s): {median(rate):.0f} img/s {[round(r) for r in rate]}", flush=True)
    res["decode"] = d = run_child(src, "decode", str(big), str(ckpt))
    d["one_worker_job_img_s"] = res["scaling_img_s"]["1"]
    print(f"  raw decode {d['raw_img_s']:.0f} img/s (issue's min 224: {d['raw224_img_s']:.0f}); transform alone "
          f"{d['transform_img_s']:.0f} ({d['transform_img_s'] / d['raw_img_s']:.2f}x); one-worker job "
          f"{d['one_worker_job_img_s']:.0f} ({d['one_worker_job_img_s'] / d['raw_img_s']:.2f}x); "
          f"pin copy {d['pin_copy_us_per_image']:.1f} us/image", flush=True)  # fmt: skip
    return res


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="repeats of each measurement (the median is kept)")
    ap.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--baseline", help="also measure the src/ of this git revision")
    ap.add_argument("--work", type=Path, help="keep the photos and checkpoint here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report: dict[str, Any] = {
        "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "images": args.images,
        "batch_size": args.batch_size, "commit": commit.stdout.strip(), "date": time.strftime("%Y-%m-%d"),
        "runs": {},
    }  # fmt: skip
    print(f"{report['cpu']}, {report['cores']} cores, batch {args.batch_size}, {args.images} JPEGs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        big, small, ckpt = prepare(work, args.images)
        versions = [("this checkout", ROOT / "src")]
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            tar = subprocess.run(["git", "archive", args.baseline, "src"], cwd=ROOT, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=tar.stdout, check=True)
            versions.insert(0, (f"baseline {args.baseline}", base / "src"))
        for name, src in versions:
            print(name, flush=True)
            report["runs"][name] = measure(src, big, small, ckpt, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


# ---- the measurements, each in its own process (the version measured first on the path) ---------------------


def child(argv: list[str]) -> dict[str, Any]:
    if argv[0] == "job":
        mode, folder, ckpt, batch, workers, *replace = argv[1:]
        return job(mode, Path(folder), Path(ckpt), int(batch), int(workers), *replace)
    return decode_rates(Path(argv[1]), Path(argv[2]))


class NoOp:
    """The model replaced: zero logits (B, K), whatever the input; counts the images it was given, and those
    given as uint8 pixels, so that a measurement in which the real model ran instead, or the GPU path was not
    taken, is refused (:func:`check_replaced`)."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.images = 0
        self.uint8 = 0

    def __call__(self, x: Any) -> Any:
        import torch

        self.images += x.shape[0]
        self.uint8 += x.shape[0] if x.dtype == torch.uint8 else 0
        return torch.zeros(x.shape[0], self.num_classes)


def check_replaced(noops: list[NoOp], images: int, mode: str, gpu_path: bool) -> None:
    """Refuse the figure unless the no-op model saw every image of the job, as uint8 pixels on the GPU path:
    where the code builds its engine elsewhere than where the benchmark replaced it, the real model ran and the
    figure is the model's, not the pipeline's (as on 320323f, where eval's '17.5 us/image' could only be
    reproduced as ~585); where the plan's ``feeds_gpu`` was not replaced, the figure is the CPU path's."""
    seen, uint8 = sum(n.images for n in noops), sum(n.uint8 for n in noops)
    if seen != images:
        raise SystemExit(
            f"{mode}: the no-op model saw {seen} of {images} images; the engine was built where the benchmark did not "
            "replace it, so this would measure the real model: no figure"
        )
    if gpu_path and uint8 != images:
        raise SystemExit(
            f"{mode}: {images - uint8} of {images} images reached the no-op as floats, not the GPU path's uint8 "
            "pixels: feeds_gpu was decided where the benchmark did not replace it; no figure"
        )


def job(mode: str, folder: Path, ckpt: Path, batch: int, workers: int, replace: str = "all") -> dict[str, Any]:
    """One job over ``folder`` with the no-op model: the main thread's and the whole process's CPU seconds and
    images per second of wall. Every mode but ``eval-cpu`` takes the path of a job whose engine is on a GPU
    (uint8 batches; the pinning and the GPU's normalisation left out); ``eval-cpu`` the path on a CPU device (the
    workers normalise). ``replace`` (the child's trailing word): ``all``, the engine and the plan's ``feeds_gpu``;
    ``engine`` leaves the plan as planned (the CPU path's transform), ``none`` the job's own engine: the cases
    of a replacement that did not take, which must be refused (``tests/bench/test_pipeline_refusal.py``)."""
    import importlib

    import torch

    import vitkit
    from vitkit.data.eval_transform import EvalTransform

    predict_module: Any = importlib.import_module("vitkit.inference.predict")  # (the package exports the function)
    features_module: Any = importlib.import_module("vitkit.inference.features")
    new = "uint8" in EvalTransform.__dataclass_fields__
    gpu_path = new and mode != "eval-cpu"
    if mode == "eval-cpu" and not new:
        return {"skipped": "the same path as eval in this version"}
    loaded = vitkit.load_checkpoint(ckpt)
    K = loaded.model.cfg.num_classes

    noops: list[NoOp] = []
    build = {"main_thread_s": 0.0, "cpu_s": 0.0}  # the engine's build, left out: a fixed cost that varies
    jobs_module: Any = importlib.import_module("vitkit.inference.jobs")
    seam = "engine" in inspect.signature(predict_module.predict_job).parameters
    engine = None
    if seam:  # the engine's documented seam (InferenceEngine's docstring): nothing patched in vitkit's modules
        engine = seam_engine(loaded, K, noops, gpu_path and replace == "all") if replace != "none" else None
    else:  # a version before the seam: patch where it builds its engine and decides feeds_gpu
        patch_engine(loaded, K, noops, gpu_path and replace == "all", replace, build, gpu_path)
    spec = jobs_module.EngineSpec.of_engine(engine) if engine is not None else None
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        start_cpu, start_main, start = time.process_time(), time.thread_time(), time.perf_counter()
        if mode.startswith("predict"):
            from vitkit.data.stream import FileSource, list_inputs

            source = FileSource(list_inputs([folder]))
            out = Path(tmp) / ("x.parquet" if mode == "predict-parquet" else "x.jsonl")
            opts = predict_module.PredictOptions(batch_size=batch, workers=workers, progress=False, precision="bf16")
            predict_module.predict_job(loaded, source, opts, out=out, **({"engine": spec} if spec else {}))
            n = len(source)
        else:
            from vitkit.data.datasets import open_dataset

            ds = open_dataset(str(folder), "test")
            kw: dict[str, Any] = {"batch_size": batch, "workers": workers, "progress": False, "precision": "bf16"}
            if hasattr(features_module, "ExtractOptions"):  # the options record, since evaluation is in one place
                got = features_module.extract(
                    spec or loaded.model, ds, loaded.meta.preprocess, opts=features_module.ExtractOptions(**kw)
                )
            else:
                got = features_module.extract(loaded.model, ds, loaded.meta.preprocess, **kw)
            n = len(got.labels)
        main_cpu = time.thread_time() - start_main - build["main_thread_s"]
        cpu = time.process_time() - start_cpu - build["cpu_s"]
        wall = time.perf_counter() - start
    check_replaced(noops, n, mode, gpu_path)
    return {"main_thread_s": main_cpu, "cpu_s": cpu, "wall_s": wall, "images": n, "img_s": n / wall,
            "build_main_thread_s": build["main_thread_s"], "build_cpu_s": build["cpu_s"]}  # fmt: skip


def seam_engine(loaded: Any, num_classes: int, noops: list[NoOp], gpu_plan: bool) -> Any:
    """The job's engine, built here before the job is timed, through the engine's seam: the plan of a bf16 engine
    (whatever the CPU: no start-up timing of ``auto``), as a plan that feeds a GPU on the GPU path, the no-op in
    the model's place and the GPU's normalisation left out (uint8 batches reach the no-op as they are)."""
    import dataclasses

    from vitkit.inference.engine import InferenceEngine
    from vitkit.inference.policy import EnginePlan, plan_engine

    class GpuFedPlan(EnginePlan):
        @property
        def feeds_gpu(self) -> bool:
            return True

    plan = plan_engine("bf16", "torch", "cpu")
    if gpu_plan:
        plan = GpuFedPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})
    engine: Any = InferenceEngine(loaded.model, loaded.meta.preprocess, plan=plan, tune=False)
    noop = NoOp(num_classes)
    engine.runner = noop
    noops.append(noop)
    if gpu_plan:
        engine.normalizer = lambda x: x
    return engine


def patch_engine(
    loaded: Any, num_classes: int, noops: list[NoOp], gpu_plan: bool, replace: str, build: dict[str, float],
    gpu_path: bool,
) -> None:  # fmt: skip
    """A version without the engine's seam: the no-op replaces ``InferenceEngine`` where the version builds it
    (the one runner, ``inference/jobs.py``, since it landed; ``predict`` and ``features`` before it), and
    ``feeds_gpu`` is made True where it is decided (a module function, then the plan's property); the build's
    CPU is counted in ``build`` to be left out."""
    import importlib

    engine_module: Any = importlib.import_module("vitkit.inference.engine")

    class NoOpEngine(engine_module.InferenceEngine):  # type: ignore[misc,name-defined]
        def __init__(self, *a: Any, **k: Any) -> None:
            main, cpu = time.thread_time(), time.process_time()
            super().__init__(*a, **k)
            build["main_thread_s"] += time.thread_time() - main
            build["cpu_s"] += time.process_time() - cpu
            self.runner = NoOp(num_classes)
            noops.append(self.runner)
            if gpu_path:
                self.normalizer = lambda x: x

    for name in ("vitkit.inference.jobs", "vitkit.inference.predict", "vitkit.inference.features"):
        if replace == "none":
            break
        try:
            module: Any = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "InferenceEngine"):
            module.InferenceEngine = NoOpEngine
        if gpu_plan and hasattr(module, "feeds_gpu"):
            module.feeds_gpu = lambda *a, **k: True
    plan_class: Any = getattr(importlib.import_module("vitkit.inference.policy"), "EnginePlan", None)
    if gpu_plan and plan_class is not None and hasattr(plan_class, "feeds_gpu"):
        plan_class.feeds_gpu = property(lambda self: True)


def decode_rates(folder: Path, ckpt: Path) -> dict[str, Any]:
    """Images per second of one process: simplejpeg alone (the transform's call and scale; the issue's
    min 224), and the transform of the job (read, decode, resize; uint8 where the code has it)."""
    import simplejpeg
    import torch

    import vitkit
    from vitkit.data.eval_transform import EvalTransform, reduced_scale
    from vitkit.images import open_lazy

    torch.set_num_threads(1)  # a worker's one thread
    pre = vitkit.load_checkpoint(ckpt).meta.preprocess
    files = sorted(str(p) for p in folder.glob("test/*/*.jpg"))
    new = "uint8" in EvalTransform.__dataclass_fields__
    transform = EvalTransform(pre, uint8=True) if new else EvalTransform(pre)  # type: ignore[call-arg]

    def raw(f: str) -> None:
        lazy = open_lazy(f)
        s = reduced_scale(lazy.width, lazy.height, pre)
        simplejpeg.decode_jpeg(lazy.data, "RGB", min_height=-(-lazy.height // s), min_width=-(-lazy.width // s),
                               min_factor=s, strict=True)  # fmt: skip

    def raw224(f: str) -> None:
        with open(f, "rb") as fh:
            simplejpeg.decode_jpeg(fh.read(), "RGB", min_height=224, min_width=224)

    def tf(f: str) -> None:
        transform(open_lazy(f), f)

    rates = {}
    for name, fn in (("raw_img_s", raw), ("raw224_img_s", raw224), ("transform_img_s", tf)):
        best = 0.0
        for _ in range(2):
            start = time.perf_counter()
            for f in files:
                fn(f)
            best = max(best, len(files) / (time.perf_counter() - start))
        rates[name] = best
    x = torch.ones(256, 3, 224, 224, dtype=torch.uint8)
    buf = torch.empty_like(x).fill_(0)
    start = time.process_time()
    for _ in range(10):
        buf.copy_(x)
    rates["pin_copy_us_per_image"] = (time.process_time() - start) / 10 / 256 * 1e6  # one thread's memcpy
    return rates


if __name__ == "__main__":
    main()
