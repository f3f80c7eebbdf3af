"""Feeds the table "GPU: vitkit against timm and transformers" of BENCHMARKS.md (``python benchmarks/run_all.py
gpu_report``; issue 27's table): B/16 and S/16 at 224 px on a CUDA GPU, bf16 autocast, inference (batch 256)
and an AdamW training step (batch 128), eager and ``torch.compile``, for vitkit, timm and transformers, runners
alternating call by call in one process; img/s, the ratio to timm, the fraction of the matmul peak measured in
the same run; plus vitkit's engine as planned for the device (``plan_engine``) and the correctness checks (fp32 on the
GPU against the fp32 CPU result, bf16 top-1 agreement, the official fixture), and ``--precision fp8`` against the
bf16 fast path (eager and compiled; top-1 agreement with fp32 on real images), or why fp8 cannot run.

    PYTHONPATH=src python benchmarks/gpu_report.py [--json F] [--markdown F] [--quick] [--no-compile] [--budget S]
        [--no-fp8 | --only-fp8]
    PYTHONPATH=src python benchmarks/gpu_report.py --device cpu --quick --no-compile   # a smoke run of the code

Where CUDA is not available (and ``--device cpu`` was not asked for) it measures nothing and writes a JSON that
says so ("skipped": "no CUDA device ..."), exit status 0. A peer that is not installed (timm, transformers) gets
rows saying so instead of numbers. ``--device cpu`` runs the same code on the CPU at whatever size is given: a
check of the script, not a figure for the table. ``--budget S`` bounds the run: a measurement not started within
S seconds of the start is left out, its row saying so. The process ends as soon as the report is written
(``os._exit``: torch.compile's worker pool once kept a finished run from exiting for minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEERS = ("vitkit", "timm", "transformers")
TIMM_NAMES = {"B/16": "vit_base_patch16_224", "S/16": "vit_small_patch16_224", "Ti/16": "vit_tiny_patch16_224"}


def peer_status(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> dict[str, str | None]:
    """None for each peer that can run here, else why not."""
    status: dict[str, str | None] = {"vitkit": None}
    for peer in ("timm", "transformers"):
        status[peer] = None if find_spec(peer) is not None else f"{peer} is not installed"
    return status


def no_cuda_reason(device: str) -> str | None:
    """Why nothing can be measured on ``device`` (None: it can)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


def build_peers(name: str, image_size: int, device: torch.device, status: dict[str, str | None]) -> dict[str, Any]:
    """The three implementations of one variant, 1000 classes, on ``device`` in fp32 (vitkit and transformers
    with the same random weights; timm its own random weights, the same architecture): a module, or the reason
    it is missing."""
    from vitkit.bench.peers import to_transformers
    from vitkit.models import create_model

    torch.manual_seed(0)
    vit = create_model(name, num_classes=1000, image_size=image_size).to(device)
    out: dict[str, Any] = {"vitkit": vit}
    if status["transformers"] is None:
        out["transformers"] = LogitsOf(to_transformers(vit))
    else:
        out["transformers"] = status["transformers"]
    if status["timm"] is None:
        try:
            import timm

            out["timm"] = timm.create_model(TIMM_NAMES[name], pretrained=False, img_size=image_size).to(device)
        except Exception as e:  # timm's import needs torchvision, which may be absent or broken
            out["timm"] = f"timm could not build {TIMM_NAMES[name]}: {type(e).__name__}: {e}"
    else:
        out["timm"] = status["timm"]
    return out


class LogitsOf(nn.Module):
    """transformers' model as ``images -> logits``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=x).logits


def _inference_fn(module: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], Any]:
    module = module.eval()

    def run() -> Any:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            return module(x)

    return run


def _train_fn(module: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Callable[[], Any]:
    from vitkit.train.optim import adam_kernel

    module = module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, **adam_kernel([{"params": params}]))  # fused where the device has it
    loss_fn = nn.CrossEntropyLoss()

    def run() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(module(x).float(), y)
        loss.backward()
        opt.step()
        return loss

    return run


def measure_task(
    name: str, task: str, batch: int, image_size: int, device: torch.device, compile: bool, repeats: int, status: dict
) -> list[dict[str, Any]]:
    """One row per peer for ``name`` (a variant), ``task`` ("inference" | "train"), eager or compiled."""
    from vitkit.timing import time_alternating

    peers = build_peers(name, image_size, device, status)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    fns: dict[str, Callable[[], Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    compile_s: dict[str, float] = {}
    for peer in PEERS:
        module = peers[peer]
        row: dict[str, Any] = {"model": name, "task": task, "batch": batch, "compiled": compile, "peer": peer}
        rows[peer] = row
        if isinstance(module, str):
            row["missing"] = module
            continue
        if compile:
            module = torch.compile(module)
        fn = _inference_fn(module, x, device) if task == "inference" else _train_fn(module, x, y, device)
        t0 = time.perf_counter()
        fn()  # warm-up (compiles)
        fn()
        _sync(device)
        compile_s[peer] = time.perf_counter() - t0
        fns[peer] = fn
    timings = time_alternating(fns, repeats, device, torch.get_num_threads()) if fns else {}
    for peer, t in timings.items():
        rows[peer]["img_per_s"] = batch / t.median
        rows[peer]["timing"] = t.to_dict()
        if compile:
            rows[peer]["first_two_calls_s"] = compile_s[peer]
    return list(rows.values())


def fast_path_row(name: str, batch: int, image_size: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """vitkit's engine as the policy plans it for the device with compiling allowed (``plan_engine("auto",
    compile=True)``: on a GPU bf16 weights, compiled, the SDPA backend measured); its runner timed bare."""
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.inference.engine import InferenceEngine
    from vitkit.inference.policy import plan_engine, sdpa_backend
    from vitkit.models import create_model
    from vitkit.timing import time_alternating

    torch.manual_seed(0)
    model = create_model(name, num_classes=1000, image_size=image_size).eval()
    t0 = time.perf_counter()
    plan = plan_engine("auto", "torch", device, batch_size=batch, compile=True)
    engine = InferenceEngine(model, Preprocess(image_size=image_size), batch_size=batch, plan=plan)
    x = torch.randn(batch, 3, image_size, image_size, device=device)

    def call() -> Any:
        with torch.no_grad(), sdpa_backend(engine.attention):
            return engine.runner(x)

    call()
    call()
    _sync(device)
    setup_s = time.perf_counter() - t0
    t = time_alternating({"fast": call}, repeats, device, torch.get_num_threads())["fast"]
    return {
        "model": name,
        "task": "inference",
        "batch": batch,
        "compiled": plan.compile,
        "peer": "vitkit engine",
        "plan": engine.describe(),
        "attention_backend": engine.attention,
        "img_per_s": batch / t.median,
        "timing": t.to_dict(),
        "setup_and_first_calls_s": setup_s,
    }


def fp8_rows(name: str, batch: int, image_size: int, device: torch.device, repeats: int, compile: bool) -> list[dict]:
    """``--precision fp8`` (``vitkit.inference.fp8``) against the engine's bf16 fast path on the same weights,
    alternating call by call: eager, and compiled unless ``compile`` is False (rowwise scales, and per-tensor
    ones); plus top-1 agreement of each with
    the fp32 model on the real images of ``vitkit bench --real-images`` (random weights, a random head)."""
    from vitkit.bench.sample_images import real_image_batch
    from vitkit.checkpoints.preprocess import Preprocess
    from vitkit.inference.fast import optimize_for_inference
    from vitkit.inference.fp8 import fp8_unsupported, to_fp8
    from vitkit.models import create_model
    from vitkit.timing import time_alternating

    base = {"model": name, "task": "inference", "batch": batch, "compiled": False}
    reason = fp8_unsupported(device)
    if reason:
        return [{**base, "peer": "vitkit fp8", "missing": reason}]
    torch.manual_seed(0)
    model = create_model(name, num_classes=1000, image_size=image_size).eval()
    with torch.no_grad():  # the head starts at zero (the paper's init): random logits to compare instead
        model.head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(2))  # type: ignore[union-attr]
    real = real_image_batch(Preprocess(image_size=image_size), digits=8)  # (N, 3, H, W)
    with torch.no_grad():
        ref = model(real).argmax(-1)
    model = model.to(device)
    runners: dict[str, Any] = {"vitkit bf16 fast path": optimize_for_inference(model, torch.bfloat16)}
    runners["vitkit fp8"] = to_fp8(model)
    if compile:
        runners["vitkit fp8 compiled"] = torch.compile(runners["vitkit fp8"])
        runners["vitkit fp8 per-tensor scales, compiled"] = torch.compile(to_fp8(model, "tensor"))
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    rows = []
    fns = {}
    for peer, run in runners.items():
        t0 = time.perf_counter()
        with torch.no_grad():
            run(x)
            run(x)
            agree = float((run(real.to(device)).float().argmax(-1).cpu() == ref).float().mean())
        _sync(device)
        rows.append({**base, "peer": peer, "compiled": "compiled" in peer, "top1_agreement_fp32": agree,
                     "setup_and_first_calls_s": time.perf_counter() - t0})  # fmt: skip
        fns[peer] = (lambda r: lambda: r(x))(run)
    with torch.no_grad():
        timings = time_alternating(fns, repeats, device, torch.get_num_threads())
    for row in rows:
        t = timings[row["peer"]]
        row.update(img_per_s=batch / t.median, timing=t.to_dict())
    bf16 = rows[0]["img_per_s"]
    for row in rows[1:]:
        row["vs_bf16_fast_path"] = row["img_per_s"] / bf16
    return rows


def correctness(device: torch.device, name: str = "B/16", image_size: int = 224) -> dict[str, Any]:
    """fp32 on the device against the fp32 CPU result (full fp32: no TF32), bf16 top-1 agreement (16 random
    images, random weights), and the official fixture (tests/fixtures: the official Flax model's logits)."""
    import numpy as np

    import vitkit
    from vitkit.hardware import restore_tf32, use_tf32
    from vitkit.models import create_model

    root = Path(__file__).resolve().parents[1]
    torch.manual_seed(0)
    model = create_model(name, num_classes=1000, image_size=image_size).eval()
    with torch.no_grad():  # the head starts at zero (the paper's init): random logits to compare instead
        model.head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(2))  # type: ignore[union-attr]
    x = torch.randn(16, 3, image_size, image_size, generator=torch.Generator().manual_seed(1))
    saved = use_tf32(device, enabled=False)
    try:
        with torch.no_grad():
            ref = model(x)
            on = copy.deepcopy(model).to(device)
            fp32 = on(x.to(device)).float().cpu()
            bf16 = on.to(torch.bfloat16)(x.to(device, torch.bfloat16)).float().cpu()
            io = np.load(root / "tests" / "fixtures" / "official_vit_tiny.io.npz")
            official = vitkit.load_pretrained(root / "tests" / "fixtures" / "official_vit_tiny.npz").to(device)
            got = official(torch.from_numpy(io["inputs_nhwc"]).permute(0, 3, 1, 2).to(device)).cpu().numpy()
    finally:
        restore_tf32(saved)

    def rel(a: Any, b: Any) -> float:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    return {
        "fp32_vs_cpu_rel_err": rel(fp32, ref),
        "bf16_vs_cpu_rel_err": rel(bf16, ref),
        "bf16_top1_agreement": float((bf16.argmax(-1) == ref.argmax(-1)).float().mean()),
        "official_fixture_rel_err": rel(got, io["logits"]),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_ratios(rows: list[dict[str, Any]], peak_flops: float | None, flops: dict[str, float]) -> None:
    """vitkit / timm for the same (model, task, compiled), and each row's achieved FLOP/s over the peak (a
    training step counted as 3x the forward's FLOPs)."""
    timm = {(r["model"], r["task"], r["compiled"]): r.get("img_per_s") for r in rows if r["peer"] == "timm"}
    for r in rows:
        rate = r.get("img_per_s")
        if rate is None:
            continue
        ref = timm.get((r["model"], r["task"], r["compiled"]))
        if r["peer"].startswith("vitkit") and ref:
            r["vs_timm"] = rate / ref
        if peak_flops:
            per_image = flops[r["model"]] * (3 if r["task"] == "train" else 1)
            r["peak_fraction"] = rate * per_image / peak_flops


def markdown(report: dict[str, Any]) -> str:
    """The BENCHMARKS.md table."""
    if "skipped" in report:
        return f"Not measured: {report['skipped']}.\n"
    lines = [
        "| model | task | mode | runner | img/s | vitkit / timm | fraction of matmul peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        mode = "compiled" if r["compiled"] else "eager"
        rate = f"{r['img_per_s']:,.0f}" if "img_per_s" in r else f"- ({r.get('missing', 'not run')})"
        ratio = f"{r['vs_timm']:.2f}x" if "vs_timm" in r else "-"
        frac = f"{100 * r['peak_fraction']:.0f}%" if "peak_fraction" in r else "-"
        if "vs_bf16_fast_path" in r:
            ratio = f"{r['vs_bf16_fast_path']:.2f}x bf16 fast path"
        if "top1_agreement_fp32" in r:
            frac += f"; top-1 = fp32 on {100 * r['top1_agreement_fp32']:.1f}% of real images"
        lines.append(f"| {r['model']} | {r['task']} b{r['batch']} | {mode} | {r['peer']} | {rate} | {ratio} | {frac} |")
    c = report.get("correctness", {})
    if c:
        lines.append("")
        lines.append(
            f"Correct on {report['device_name']}: fp32 against the CPU {c['fp32_vs_cpu_rel_err']:.1e} relative, bf16 "
            f"{c['bf16_vs_cpu_rel_err']:.1e} with {100 * c['bf16_top1_agreement']:.0f}% top-1 agreement, the official "
            f"fixture {c['official_fixture_rel_err']:.1e} ({c['model']}, random weights)."
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, status: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The report: ``status`` says which peers can run (default: ``peer_status()``)."""
    status = status if status is not None else peer_status()
    report: dict[str, Any] = {"device": args.device, "peers": status, "quick": args.quick}
    reason = no_cuda_reason(args.device)
    if reason:
        report["skipped"] = reason
        return report
    from vitkit.bench.harness import flops_per_image, machine_info
    from vitkit.bench.peak import measure_peak
    from vitkit.models import create_model

    device = torch.device(args.device)
    report["machine"] = machine_info(device)
    report["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    size, models = args.image_size, args.models
    flops = {}
    for m in models:
        with torch.device("meta"):
            flops[m] = flops_per_image(create_model(m, num_classes=1000, image_size=size), size)
    peak = measure_peak("bf16", device)
    report["peak"] = {"precision": "bf16", "flops": peak.flops, "method": peak.method, "detail": peak.detail}
    rows: list[dict[str, Any]] = []
    modes = [False] if args.no_compile else [False, True]
    start = time.perf_counter()

    def over(what: dict[str, Any]) -> bool:
        late = args.budget is not None and time.perf_counter() - start > args.budget
        if late:
            rows.append({**what, "peer": "all", "missing": f"not run: over --budget {args.budget:g} s"})
        return late

    for m in models:
        for compiled in modes if not args.only_fp8 else []:
            for task, batch in (("inference", args.batch), ("train", args.train_batch)):
                if not over({"model": m, "task": task, "batch": batch, "compiled": compiled}):
                    rows += measure_task(m, task, batch, size, device, compiled, args.repeats, status)
        if not args.only_fp8 and not over({"model": m, "task": "inference", "batch": args.batch, "compiled": True}):
            rows.append(fast_path_row(m, args.batch, size, device, args.repeats))
        if not args.no_fp8 and not over({"model": m, "task": "inference fp8", "batch": args.batch, "compiled": False}):
            rows += fp8_rows(m, args.batch, size, device, args.repeats, compile=not args.no_compile)
    add_ratios(rows, peak.flops, flops)
    report["rows"] = rows
    report["correctness"] = correctness(device, models[0], size)
    report["correctness"]["model"] = f"{models[0]} at {size} px"
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to check the script")
    ap.add_argument("--models", nargs="+", default=None, help="variants (default B/16 S/16; --quick: Ti/16)")
    ap.add_argument("--image-size", type=int, default=None, help="default 224 (--quick: 32)")
    ap.add_argument("--batch", type=int, default=None, help="inference batch (default 256; --quick: 4)")
    ap.add_argument("--train-batch", type=int, default=None, help="training batch (default 128; --quick: 4)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per runner (default 10; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the table's numbers")
    ap.add_argument("--no-compile", action="store_true", help="eager runners only")
    ap.add_argument("--no-fp8", action="store_true", help="leave out the fp8 rows")
    ap.add_argument("--only-fp8", action="store_true", help="only the fp8 rows (and the correctness checks)")
    ap.add_argument("--budget", type=float, default=None, help="seconds: measurements not started by then are skipped")
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON")
    ap.add_argument("--markdown", metavar="FILE", help="write the BENCHMARKS.md table")
    args = ap.parse_args(argv)
    quick = args.quick
    args.models = args.models or (["Ti/16"] if quick else ["B/16", "S/16"])
    args.image_size = args.image_size or (32 if quick else 224)
    args.batch = args.batch or (4 if quick else 256)
    args.train_batch = args.train_batch or (4 if quick else 128)
    args.repeats = args.repeats or (2 if quick else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    table = markdown(report)
    report["markdown"] = table
    print(table, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    import os

    code = 1
    with contextlib.suppress(BrokenPipeError):
        code = main()
        sys.stdout.flush()
    os._exit(code)  # not sys.exit: torch.compile's compile workers can hold a finished process for minutes
