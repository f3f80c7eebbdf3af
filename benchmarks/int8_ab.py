"""Variants of the inference fast path's block, end to end, alternating call by call in one process.

The bf16 and/or int8 fast path is built once per precision; each variant (``--variant``) sets byte budgets of
every ``FastBlock`` before its call, in MiB: ``attn_bytes`` (the attention half of the block, LN -> qkv ->
attention -> out-projection + residual, over groups of images whose qkv output is at most that many bytes; 0 =
all at once) and ``mlp_bytes`` (the MLP over chunks of rows of at most that much hidden activation); and, for
int8, ``native=1`` or ``native=0``: activations quantised by the C kernel or by its fallback, the inductor-compiled
quantiser (``vitkit.inference.int8.NativeQuantizer``); ``int8attn=1`` or ``int8attn=0``: the fused attention
kernel's int8 variant (``attention_int8.c``) or the bf16 kernel; ``vnni=1`` or ``vnni=0``: the int8 GEMMs by the
VNNI kernel (``vitkit.inference.gemm_int8``) or by oneDNN (weights pre-packed for it at the first such call);
``lnq=1`` or ``lnq=0``: norm1 -> qkv and norm2 -> fc1 as one LayerNorm + quantise C kernel
(``vitkit.inference.int8.LayerNormQuantize``) or LayerNorm then the quantiser; ``gemm=1`` or ``gemm=0``: the VNNI
GEMM kernel as built from this tree or from ``gemm_int8.c`` at the git revision ``--gemm-rev`` (default main; the
same packed weights), to compare a change of the kernel; ``rowq=1`` or ``rowq=0``: the inputs of proj and fc2 (attention
output, fc1's output) quantised per row (``NativeQuantizer.per_row``, a scale and zero point per row in the VNNI
GEMM) or per tensor. After 2
warm-up rounds the variants are timed call by call, alternating (``vitkit.timing.time_alternating``)::

    flock /tmp/vitkit-cpu.lock env PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/int8_ab.py B/16 \\
        --variant attn_bytes=0 attn_bytes=16 mlp_bytes=5,attn_bytes=0

Prints img/s medians (best call) per variant, their ratio to the first variant, and the relative difference
of each variant's final tokens from the first's.
"""

from __future__ import annotations

import argparse
import functools
import subprocess

import torch

from vitkit import native, optimize_for_inference
from vitkit.inference import attention, gemm_int8
from vitkit.inference.fast import FastBlock, InferenceViT
from vitkit.inference.int8 import Int8Linear, NativeQuantizer
from vitkit.models import create_model
from vitkit.timing import time_alternating


def revision_gemm(rev: str) -> gemm_int8.Int8Gemm:
    """The VNNI GEMM kernel compiled from ``gemm_int8.c`` as it is at git revision ``rev``."""
    path = "src/vitkit/inference/gemm_int8.c"
    text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    source = f'{native.SHARED_HEADER.read_text()}\n#line 1 "gemm_int8.c"\n{text}'
    lib = native.load(source, "vk_gemm_int8", gemm_int8.FLAGS, gemm_int8.NEEDS)
    assert lib is not None, "the kernel did not build"
    return gemm_int8.Int8Gemm(lib)


def configure(fast: InferenceViT, settings: dict[str, float], kernels: dict[object, object]) -> None:
    for b in fast.blocks:
        if not isinstance(b, FastBlock):
            continue
        for k, v in settings.items():
            if k == "int8attn":
                b.fused = kernels[bool(v)]  # type: ignore[assignment]
                continue
            if k == "vnni":  # the int8 GEMM: the VNNI kernel (1) or oneDNN's (0)
                for m in b.modules():
                    if isinstance(m, Int8Linear):
                        kernel = m.gemm or m.vnni  # type: ignore[has-type]
                        m.vnni = kernel  # type: ignore[assignment]
                        m.gemm = kernel if v else None
                continue
            if k == "rowq":  # int8: proj's and fc2's inputs quantised per row (1) or per tensor (0)
                rows = kernels.setdefault("rows", b.rows_quantize)
                assert rows is not None, "no per-row quantiser here (C quantiser and VNNI GEMM needed)"
                b.rows_quantize = rows if v else None  # type: ignore[assignment]
                continue
            if k == "gemm":  # the VNNI GEMM built from this tree (1) or from --gemm-rev (0)
                for m in b.modules():
                    if isinstance(m, Int8Linear):
                        m.gemm = kernels[("gemm", bool(v))]  # type: ignore[assignment]
                continue
            if k == "lnq":  # int8: LayerNorm fused with the activation quantiser (1) or LN then quantiser (0)
                b.fuse_norm = bool(v) and b.norm1_q.fn is not None
                continue
            if k != "native":
                setattr(b, k, int(v * (1 << 20)))
                continue
            for m in b.modules():
                if isinstance(m, Int8Linear):
                    native = m.quantize if isinstance(m.quantize, NativeQuantizer) else m.native
                    m.native = native  # type: ignore[assignment]
                    m.quantize = native if v else native.fallback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--precision", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    ap.add_argument(
        "--variant", nargs="+", default=["attn_bytes=0"], help="NAME=MiB[,NAME=MiB] per variant (FastBlock budgets)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gemm-rev", default="main", help="git revision of gemm_int8.c for the variant gemm=0")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = create_model(args.model).eval()
    x = torch.randn(args.batch_size, 3, 224, 224)
    variants = {v: {k: float(m) for k, m in (kv.split("=") for kv in v.split(","))} for v in args.variant}
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    kernels: dict[object, object] = {False: attention.load(), True: attention.load_int8()}
    if any("gemm=" in v for v in args.variant):
        kernels[("gemm", True)], kernels[("gemm", False)] = gemm_int8.load(), revision_gemm(args.gemm_rev)
    for precision in args.precision:
        fast = optimize_for_inference(model, batch_size=args.batch_size, int8=precision == "int8")
        assert isinstance(fast, InferenceViT)
        outs: dict[str, torch.Tensor] = {}

        def run(name: str, fast: InferenceViT = fast, outs: dict[str, torch.Tensor] = outs) -> None:
            configure(fast, variants[name], kernels)
            outs[name] = fast.forward_features(x)

        fns = {name: functools.partial(run, name) for name in variants}
        with torch.inference_mode():
            time_alternating(fns, 2, cpu, threads)  # warm-up
            timings = time_alternating(fns, args.repeats, cpu, threads)
        first = next(iter(variants))
        base = args.batch_size / timings[first].median
        for name, t in timings.items():
            rate = args.batch_size / t.median
            ref = outs[first].float()
            diff = ((outs[name].float() - ref).norm() / ref.norm()).item()
            print(
                f"{args.model} b{args.batch_size} {precision} {name}: {rate:.2f} img/s "
                f"(best {args.batch_size / min(t.times):.2f}), x{rate / base:.3f}, cpu {t.cpu_util:.2f}, "
                f"tokens rel. diff {diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
