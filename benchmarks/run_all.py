"""Runs the benchmark report of BENCHMARKS.md: every table, or the ones named, and writes each table's results to
``benchmarks/results/<table>.json`` (machine, commit, date and the commands inside), replacing the last run.

    python benchmarks/run_all.py                    # the whole report (an hour or more on 2 cores)
    python benchmarks/run_all.py inference serving  # some tables
    python benchmarks/run_all.py --quick            # every table at a small size (minutes): a smoke run,
                                                    # its JSON says "quick": true; not what the tables quote
    python benchmarks/run_all.py --list             # the tables and their commands

Heavy work: on a shared machine wrap it in the machine's lock (``flock /tmp/vitkit-cpu.lock python ...``). The
commands run with this checkout's ``src/`` first on the path. A table that cannot run on this machine (no CPU
without AVX-512 here, no GPU) is written with ``"skipped"`` and the reason, so the JSON says what was not
measured rather than keeping an older machine's numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
BENCH = [PY, "-m", "vitkit", "bench"]
BATCH_STEPS = ["bench", "eval", "predict", "eval-old", "predict-old", "memory"]


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def no_avx512() -> str | None:
    """None where this CPU lacks AVX-512 (the table can run), else why it is skipped."""
    return "this CPU has AVX-512 (avx512f)" if "avx512f" in cpu_flags() else None


def has_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device on this machine"


@dataclass
class Table:
    """One table of BENCHMARKS.md: the question it answers and the commands that produce it (each gets
    ``--json FILE`` appended; ``{json}`` in a command stands for that file)."""

    name: str
    question: str
    full: list[list[str]]
    quick: list[list[str]]
    skip: Callable[[], str | None] = field(default=lambda: None)


TABLES = [
    Table(
        "interop",
        "Checkpoint interop: relative error of each format against its reference",
        [[PY, "benchmarks/interop_errors.py"]],
        [[PY, "benchmarks/interop_errors.py"]],
    ),
    Table(
        "default_job",
        "The default job (vitkit train): test top-1 per seed and wall time",
        [[PY, "benchmarks/default_job.py", "--seeds", "0", "1", "2", "3"]],
        [[PY, "benchmarks/default_job.py", "--seeds", "0"]],
    ),
    Table(
        "busy",
        "A busy machine: the default job and a finetune beside one CPU-bound program, default threads and 1 thread",
        [[PY, "benchmarks/busy_machine.py"]],
        [[PY, "benchmarks/busy_machine.py", "--finetune-steps", "50"]],
    ),
    Table(
        "inference",
        "Inference img/s against transformers, ONNX Runtime and OpenVINO (bf16, int8; B/16, S/16, Ti/16)",
        [
            [
                *BENCH,
                "B/16",
                "--batch-size",
                "32",
                "--precision",
                "bf16-autocast",
                "bf16",
                "int8",
                "--compare",
                "transformers",
                "--repeats",
                "3",
                "--no-latency",
            ],
            [
                *BENCH,
                "B/16",
                "--batch-size",
                "32",
                "--precision",
                "bf16",
                "int8",
                "--compare",
                "onnxruntime",
                "openvino",
                "--repeats",
                "3",
                "--no-latency",
            ],
            [
                *BENCH,
                "S/16",
                "--batch-size",
                "32",
                "--precision",
                "bf16",
                "int8",
                "--compare",
                "transformers",
                "--repeats",
                "5",
                "--no-latency",
            ],
            [
                *BENCH,
                "Ti/16",
                "--batch-size",
                "32",
                "--precision",
                "bf16",
                "int8",
                "--compare",
                "transformers",
                "--repeats",
                "5",
                "--no-latency",
            ],
        ],
        [
            [
                *BENCH,
                "Ti/16",
                "--batch-size",
                "8",
                "--precision",
                "bf16",
                "int8",
                "--compare",
                "transformers",
                "--repeats",
                "2",
                "--no-latency",
            ]
        ],
    ),
    Table(
        "int8_agreement",
        "Does int8 change predictions? Top-1, embedding and kNN agreement with fp32 on trained models",
        [[PY, "benchmarks/digits_agreement.py", "--family", f] for f in ("vit", "dinov2", "siglip")],
        [[PY, "benchmarks/digits_agreement.py", "--family", f, "--epochs", "2"] for f in ("vit", "dinov2", "siglip")],
    ),
    Table(
        "training_step",
        "Training step img/s against transformers (S/16, bf16 autocast, AdamW)",
        [
            [
                *BENCH,
                "S/16",
                "--task",
                "train",
                "--precision",
                "bf16-autocast",
                "--batch-size",
                "32",
                "--repeats",
                "5",
                "--compare",
                "transformers",
            ]
        ],
        [
            [
                *BENCH,
                "Ti/16",
                "--task",
                "train",
                "--precision",
                "bf16-autocast",
                "--batch-size",
                "8",
                "--repeats",
                "2",
                "--compare",
                "transformers",
                "--no-latency",
            ]
        ],
    ),
    Table(
        "input_pipeline",
        "Input pipeline: JPEG decode + augmentation per worker against the plain Pillow path",
        [[PY, "benchmarks/input_pipeline.py"]],
        [[PY, "benchmarks/input_pipeline.py", "--images", "40", "--sizes", "224", "--rounds", "2", "--steps", "2"]],
    ),
    Table(
        "pipeline",
        "Batch jobs' input pipeline: main-process CPU per image, workers against raw decoding (no-op model)",
        [[PY, "benchmarks/pipeline.py", "--baseline", "78bcf52"]],
        [
            [
                PY,
                "benchmarks/pipeline.py",
                "--images",
                "256",
                "--batch-size",
                "64",
                "--rounds",
                "1",
                "--max-workers",
                "1",
            ]
        ],
    ),
    Table(
        "batch_inference",
        "Batch inference: vitkit eval and predict end to end against vitkit bench, the old defaults, and memory",
        [
            [PY, "benchmarks/batch_inference.py", "--models", "S/16", "B/16", "--steps", *BATCH_STEPS],
        ],
        [
            [
                PY,
                "benchmarks/batch_inference.py",
                "--images",
                "64",
                "--memory-images",
                "300",
                "--models",
                "Ti/16",
                "--memory-model",
                "Ti/16",
                "--batch-size",
                "8",
                "--repeats",
                "2",
                "--steps",
                *BATCH_STEPS,
            ],
        ],
    ),
    Table(
        "engine_agreement",
        "Batch inference: top-1 agreement of bf16, int8 and auto with fp32 through vitkit predict on trained runs",
        [[PY, "benchmarks/engine_agreement.py"]],
        [[PY, "benchmarks/engine_agreement.py", "--digits-epochs", "2", "--b16-epochs", "1"]],
    ),
    Table(
        "validation_pass",
        "Batch inference: a training run's validation pass on the inference engine against the model itself",
        [[PY, "benchmarks/validation_pass.py"]],
        [[PY, "benchmarks/validation_pass.py", "--images", "32", "--repeats", "1", "--models", "Ti/16"]],
    ),
    Table(
        "serving",
        "Serving under load: throughput and latency of vitkit serve against offline batches",
        [[PY, "benchmarks/serve_load.py"]],
        [[PY, "benchmarks/serve_load.py", "--model", "Ti/16", "--single", "10", "--requests", "40", "--clients", "4"]],
    ),
    Table(
        "serve_memory",
        "Serving: resident memory of vitkit serve under a flood of maximum-size uploads",
        [[PY, "benchmarks/serve_memory.py", "--clients", "8", "32", "64", "128", "--seconds", "25"]],
        [[PY, "benchmarks/serve_memory.py", "--clients", "4", "--seconds", "5"]],
    ),
    Table(
        "adaptation",
        "Adaptation: every method's default (seeds 0-3), and accuracy and wall time per method on new classes",
        [
            [PY, "benchmarks/adaptation.py", "backbone"],
            [PY, "benchmarks/adaptation.py", "defaults", "--seeds", "0,1,2,3"],
            [PY, "benchmarks/adaptation.py", "defaults", "--target", "photos", "--seeds", "0,1,2,3"],
            [PY, "benchmarks/adaptation.py", "defaults", "--seeds", "0,1,2,3", "--sweep"],
            [PY, "benchmarks/adaptation.py", "defaults", "--target", "photos", "--seeds", "0,1,2,3", "--sweep"],
            [PY, "benchmarks/adaptation.py", "defaults", "--target", "gratings", "--seeds", "0,1,2,3"],
            [PY, "benchmarks/adaptation.py", "digits", "--shots", "1,5,10,25,full"],
            [PY, "benchmarks/adaptation.py", "photos"],
        ],
        [
            [PY, "benchmarks/adaptation.py", "backbone"],
            [PY, "benchmarks/adaptation.py", "defaults", "--seeds", "0"],
            [PY, "benchmarks/adaptation.py", "digits", "--shots", "5"],
        ],
    ),
    Table(
        "adaptation_memory",
        "Adaptation: LoRA's peak training memory and step time against full fine-tuning (S/16, B/16, 224 px)",
        [[PY, "benchmarks/lora_memory.py"]],
        [[PY, "benchmarks/lora_memory.py", "--variants", "Ti/16", "--steps", "2", "--batch", "4"]],
    ),
    Table(
        "adaptation_features",
        "Adaptation: the linear method's feature pass in fp32 against the fast path's bf16 and int8 (B/16, 224 px)",
        [[PY, "benchmarks/adaptation.py", "features", "B/16"]],
        [[PY, "benchmarks/adaptation.py", "features", "Ti/16", "--images", "16", "--rounds", "1"]],
    ),
    Table(
        "no_avx512",
        "CPUs without AVX-512: the default bench command against transformers in fp32 and int8",
        [[*BENCH, "--compare", "transformers", "--precision", "fp32", "int8"]],
        [[*BENCH, "--compare", "transformers", "--precision", "fp32", "int8", "--repeats", "2", "--no-latency"]],
        no_avx512,
    ),
    Table(
        "gpu",
        "GPU: B/16 inference and an S/16 training step against transformers on CUDA",
        [
            [
                *BENCH,
                "B/16",
                "--device",
                "cuda",
                "--batch-size",
                "64",
                "--precision",
                "bf16",
                "--compare",
                "transformers",
                "--compile",
            ],
            [
                *BENCH,
                "S/16",
                "--device",
                "cuda",
                "--task",
                "train",
                "--batch-size",
                "128",
                "--precision",
                "bf16-autocast",
                "--compare",
                "transformers",
            ],
        ],
        [[*BENCH, "Ti/16", "--device", "cuda", "--batch-size", "8", "--repeats", "2", "--compare", "transformers"]],
        has_gpu,
    ),
    Table(
        "gpu_report",
        "GPU: vitkit against timm and transformers (B/16, S/16; inference and training; eager and compiled)",
        [[PY, "benchmarks/gpu_report.py"]],
        [[PY, "benchmarks/gpu_report.py", "--quick"]],
        has_gpu,
    ),
    Table(
        "search",
        "Similarity search: exact against approximate (HNSW) libraries",
        [[PY, "benchmarks/search_ann.py", "--n", "200000", "--ef", "32", "64", "128", "256"]],
        [[PY, "benchmarks/search_ann.py", "--n", "20000", "--queries", "200", "--ef", "64"]],
    ),
    Table(
        "search-1m",
        "Similarity search at 1M vectors: exact against the IVF lists",
        [[PY, "benchmarks/search_ann.py", "--n", "1000000", "--libs", "exact", "ivf", "--nprobe", "4", "8", "16"]],
        [[PY, "benchmarks/search_ann.py", "--n", "20000", "--queries", "200", "--libs", "exact", "ivf"]],
    ),
    Table(
        "search-e2e",
        "Similarity search end to end: vitkit index + search against vitkit embed",
        [[PY, "benchmarks/search_e2e.py", "--images", "10000", "--precision", "fp32"]],
        [[PY, "benchmarks/search_e2e.py", "--images", "200", "--queries", "20", "--precision", "fp32"]],
    ),
    Table(
        "families",
        "Model families: the fast path against transformers",
        [[PY, "benchmarks/families.py", "dinov2-s14-reg4", "siglip-b16", "--batch-size", "32", "--repeats", "5"]],
        [[PY, "benchmarks/families.py", "dinov2-s14-reg4", "--batch-size", "4", "--repeats", "1"]],
    ),
]


def machine() -> dict[str, object]:
    """What the numbers were measured on: the CPU as lscpu names it, its AVX-512 features, the software."""
    info: dict[str, str] = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model") and key.strip() not in info:
                info[key.strip()] = value.strip()
    flags = cpu_flags()
    versions = {}
    for pkg in ("torch", "transformers", "onnxruntime", "openvino", "numpy"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": info.get("model name", platform.processor()),
        "cpu_family": info.get("cpu family"),
        "cpu_model": info.get("model"),
        "cpu_features": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
    }


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_table(table: Table, quick: bool) -> dict[str, object]:
    record: dict[str, object] = {
        "table": table.name,
        "question": table.question,
        "quick": quick,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short=7", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "command": f"python benchmarks/run_all.py {table.name}" + (" --quick" if quick else ""),
    }
    reason = table.skip()
    if reason:
        record["skipped"] = reason
        return record
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for argv in table.quick if quick else table.full:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            shown = " ".join(a if a != PY else "python" for a in argv)
            print(f"[{table.name}] {shown}", flush=True)
            t0 = time.perf_counter()
            subprocess.run([*argv, "--json", str(out)], cwd=ROOT, env=env, check=True)
            runs.append(
                {
                    "argv": shown,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "result": json.loads(out.read_text()),
                }
            )
    record["runs"] = runs
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", metavar="TABLE", help="tables to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every command")
    ap.add_argument("--list", action="store_true", help="print the tables and their commands, run nothing")
    args = ap.parse_args()
    by_name = {t.name: t for t in TABLES}
    unknown = [n for n in args.tables if n not in by_name]
    if unknown:
        ap.error(f"unknown table(s) {', '.join(unknown)}; tables: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.tables] or TABLES
    if args.list:
        for t in chosen:
            print(f"{t.name}: {t.question}")
            for argv in t.quick if args.quick else t.full:
                print("   ", " ".join(a if a != PY else "python" for a in argv))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    for t in chosen:
        record = run_table(t, args.quick)
        path = RESULTS / f"{t.name}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"[{t.name}] {'skipped: ' + str(record['skipped']) if 'skipped' in record else 'written'}: {path}")


if __name__ == "__main__":
    main()
