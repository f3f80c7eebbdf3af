"""Peak measurement, timing statistics, memory measurement and the benchmark run (tiny models, no timing
asserts)."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from vitkit import hardware, native
from vitkit.bench import peak as peak_mod
from vitkit.bench.harness import BenchSpec, run_bench
from vitkit.bench.measure import peak_memory
from vitkit.bench.report import format_report
from vitkit.errors import ConfigError
from vitkit.timing import Timing

FLAGS = hardware.cpu_flags()
HAS_FMA_LOOP = shutil.which("cc") is not None and ("avx512f" in FLAGS or {"avx2", "fma"} <= FLAGS)


@pytest.mark.skipif(not HAS_FMA_LOOP, reason="needs a C compiler and an AVX2 or AVX-512 CPU")
def test_fma_loop_peak_is_measured_with_the_c_kernel() -> None:
    p = peak_mod.measure_peak("fp32", threads=1)
    assert p.method == "fma-loop" and p.threads == 1 and p.flops > 1e9
    assert p.detail.startswith("vk_fp32" if "avx512f" in FLAGS else "vk_fp32_avx2")


@pytest.mark.skipif(not HAS_FMA_LOOP or not {"avx2", "fma"} <= FLAGS, reason="needs a C compiler and AVX2")
def test_a_cpu_without_bf16_instructions_gets_its_fp32_rate_as_bf16_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx", "avx2", "fma"})
    p = peak_mod.measure_peak("bf16", threads=1)
    assert p.method == "fma-loop" and "vk_fp32_avx2" in p.detail and "no bf16 instructions" in p.detail
    assert peak_mod.fma_loop_peak("int8") is None  # no VNNI: int8 falls back to the int8 GEMM rate


def test_matmul_peak_stops_growing_at_its_time_budget() -> None:
    p = peak_mod.matmul_peak("bf16", budget_s=0.0)
    assert p.method == "matmul" and p.detail.startswith("256x256x256") and p.flops > 0
    q = peak_mod.matmul_peak("int8", size=128)
    assert q.detail.startswith("128x128x128") and q.flops > 0
    if torch.backends.mkldnn.is_available():
        assert "onednn u8s8" in q.detail


def test_without_a_compiler_the_peak_falls_back_to_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "compiler", lambda: None)
    p = peak_mod.measure_peak("fp32")
    assert p.method == "matmul" and p.flops > 0
    with pytest.raises(ValueError, match="precision"):
        peak_mod.measure_peak("fp8")


def test_timing_statistics() -> None:
    t = Timing([4.0, 1.0, 3.0, 2.0, 5.0], cpu_util=1.0)
    assert t.median == 3.0
    assert t.iqr == (2.0, 4.0)
    assert t.to_dict()["min_s"] == 1.0


def test_peak_memory_sees_a_large_allocation() -> None:
    def allocate() -> None:
        x = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        assert float(x[-1]) == 1.0

    mem = peak_memory(allocate, torch.device("cpu"))
    if mem["delta_mib"] is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert mem["delta_mib"] > 60


def test_inference_bench_against_transformers() -> None:
    spec = BenchSpec(
        model="Ti/16",
        image_size=32,
        batch_size=2,
        precisions=("fp32", "bf16"),
        compare=("transformers",),
        repeats=2,
        real_images=True,
    )
    result = run_bench(spec)
    rows = {r["runner"]: r for r in result["results"]}
    assert set(rows) == {
        "vitkit [fp32]", "transformers [fp32]", "vitkit-fast [fp32]",
        "vitkit [bf16]", "transformers [bf16]", "vitkit-fast [bf16]",
    }  # fmt: skip
    assert rows["transformers [fp32]"]["agreement_vs_fp32"]["rel_err"] < 1e-5  # same weights, same function
    assert rows["vitkit-fast [fp32]"]["agreement_vs_fp32"]["rel_err"] < 1e-5
    real = rows["transformers [fp32]"]["agreement_real_images"]
    assert real["images"] == 24 + 104 and real["top1_agreement"] == 1.0 and real["rel_err"] < 1e-5
    assert rows["vitkit-fast [bf16]"]["agreement_vs_fp32"]["rel_err"] < 3e-2
    ours, peer = rows["vitkit [bf16]"], rows["transformers [bf16]"]
    assert ours["speedup_vs_peer_same_precision"] == pytest.approx(ours["img_per_s"] / peer["img_per_s"])
    assert len(rows["vitkit [fp32]"]["timing"]["times_s"]) == 2
    fp32 = rows["vitkit [fp32]"]
    assert fp32["img_per_s"] == pytest.approx(spec.batch_size / fp32["timing"]["median_s"])
    assert fp32["fraction_of_peak"] == pytest.approx(fp32["achieved_flops"] / result["peaks"]["fp32"]["flops"])
    assert fp32["achieved_flops"] == pytest.approx(result["gflops_per_image"] * 1e9 * fp32["img_per_s"])
    assert result["peaks"]["bf16"]["method"] in ("fma-loop", "matmul")
    assert "latency_b1_ms" in rows["vitkit [bf16]"]
    assert "x same" in format_report(result)


def test_train_bench_checkpointing_computes_the_same_steps() -> None:
    spec = BenchSpec(
        model="Ti/16", image_size=32, batch_size=4, task="train", precisions=("fp32",), compare=("transformers",),
        grad_checkpointing=True, repeats=1,
    )  # fmt: skip
    rows = {r["runner"]: r for r in run_bench(spec)["results"]}
    plain, ckpt = rows["vitkit [fp32]"]["losses"], rows["vitkit+ckpt [fp32]"]["losses"]
    peer = rows["transformers [fp32]"]["losses"]
    assert len(rows) == 8  # {vitkit, transformers} x {fused, explicit attention} x {plain, checkpointed}
    assert len(plain) == 3  # warm-up, timed, memory: three optimiser steps on the same batch
    assert plain == pytest.approx(ckpt, rel=1e-5)  # recomputation changes nothing
    assert plain == pytest.approx(rows["vitkit+math-attn+ckpt [fp32]"]["losses"], rel=1e-4)
    assert plain == pytest.approx(rows["transformers+eager-attn [fp32]"]["losses"], rel=1e-4)
    assert plain == pytest.approx(peer, rel=1e-4)  # same weights, loss and optimiser as transformers
    assert plain[2] < plain[0]  # the steps do optimise


def test_bad_specs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="training"):
        run_bench(BenchSpec(task="train", precisions=("bf16",)))
    with pytest.raises(ConfigError, match="compare"):
        run_bench(BenchSpec(compare=("timm",)))


@pytest.mark.parametrize(
    ("name", "bf16_tflops"),
    [
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40", 181.0),  # not the L4 entry
        ("NVIDIA L40S", 362.1),
        ("NVIDIA H100 80GB HBM3", 989.4),  # SXM5
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),  # not the SXM value
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_peak_table_matches_whole_words(name: str, bf16_tflops: float | None) -> None:
    got = peak_mod.gpu_spec_peak(name, "bf16")
    assert (None if got is None else got.flops / 1e12) == bf16_tflops


@pytest.mark.skipif(not HAS_FMA_LOOP or not {"avx512f", "avx512_vnni"} <= FLAGS, reason="needs a C compiler and VNNI")
def test_each_peak_loop_does_the_multiply_adds_it_is_counted_for() -> None:
    # The peak divides chains x instructions' work by the time: each loop must run exactly that many. With
    # x = 2 (u8) and y = 1 (s8), every vpdpbusd adds 4 x 2 = 8 to each of its 16 lanes; chain i starts at i.
    lib = peak_mod._build_kernels(FLAGS)
    assert lib is not None
    for symbol, _, _, chains in peak_mod._KERNELS["int8"]:
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_float]
        iters = 1000
        assert fn(iters, 2.0) == 16 * (sum(range(chains)) + chains * 8 * iters), symbol


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_gemm_peak_times_the_models_own_shapes(precision: str) -> None:
    p = peak_mod.gemm_peak(precision, [(64, 32, 96), (64, 128, 32)], repeats=1)
    assert p.method == "amx-matmul" and p.flops > 0
    assert p.detail.startswith("best of the model's GEMMs: 64x")


def test_on_amx_the_peak_is_what_the_tiles_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AMX Xeon's bf16 GEMMs ran at 440-529% of the AVX512-BF16 loop: there the denominator is the GEMMs'."""
    loop = peak_mod.Peak("bf16", 1e11, "fma-loop", 2, "vk_bf16")
    tiles = peak_mod.Peak("bf16", 5e11, "amx-matmul", 2, "best of the model's GEMMs: 6304x768x3072")
    asked: list[object] = []
    monkeypatch.setattr(peak_mod, "fma_loop_peak", lambda precision, threads=None: loop)
    monkeypatch.setattr(peak_mod, "gemm_peak", lambda precision, shapes: asked.append(shapes) or tiles)
    shapes = [(6304, 768, 3072)]
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert peak_mod.measure_peak("bf16", gemm_shapes=shapes) is tiles and asked == [shapes]
    # the loop stays where it is the higher one, and fp32 (no fp32 tiles) never asks the GEMMs
    slow = peak_mod.Peak("bf16", 5e10, "amx-matmul", 2, "x")
    monkeypatch.setattr(peak_mod, "gemm_peak", lambda precision, shapes: slow)
    assert peak_mod.measure_peak("bf16", gemm_shapes=shapes) is loop
    asked.clear()
    monkeypatch.setattr(peak_mod, "gemm_peak", lambda precision, shapes: asked.append(shapes) or tiles)
    peak_mod.measure_peak("fp32", gemm_shapes=shapes)
    assert not asked
    # without AMX (AVX-512 with BF16: Zen 4, older Xeons) the vector loop is the peak, as before
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert peak_mod.measure_peak("bf16", gemm_shapes=shapes) is loop and not asked


def _row(runner: str, impl: str, precision: str, ips: float, rel_err: float, top1: float) -> dict[str, object]:
    agree = {"rel_err": rel_err, "top1_agreement": top1}
    return {"runner": runner, "impl": impl, "precision": precision, "img_per_s": ips, "agreement_vs_fp32": agree}


def test_a_peer_computing_another_function_is_left_out_of_the_ratios() -> None:
    """vitkit's own bench found OpenVINO int8 (NNCF, random weights) at rel err 0.38, top-1 agreement 0.375."""
    from vitkit.bench.report import add_ratios

    rows = [
        _row("vitkit-fast [int8]", "vitkit-fast", "int8", 24.4, 0.03, 0.97),
        _row("openvino [int8]", "openvino", "int8", 34.7, 0.38, 0.375),
        _row("onnxruntime [int8]", "onnxruntime", "int8", 20.0, 0.05, 0.95),
    ]
    add_ratios(rows)
    fast, ov, ort = rows
    assert "different function" in str(ov["left_out"]) and "0.375" in str(ov["left_out"])
    assert "left_out" not in ort
    assert fast["peer_best"] == "onnxruntime [int8]" and fast["speedup_vs_peer_best"] == pytest.approx(24.4 / 20.0)
    text = format_report(
        {
            "spec": {"task": "inference", "image_size": 224, "batch_size": 32},
            "model_name": "B/16",
            "tokens": 197,
            "machine": {"cpu": "x", "threads": 2},
            "gflops_per_image": 17.6,
            "peaks": {},
            "results": [
                {
                    **r,
                    "img_per_s_best": r["img_per_s"],
                    "achieved_flops": 1e9,
                    "fraction_of_peak": 0.5,
                    "memory": {"delta_mib": 1.0},
                    "timing": {"q1_s": 1.0, "q3_s": 1.0, "cpu_util": 1.0},
                }
                for r in rows
            ],
        }
    )
    assert "openvino [int8]: left out of x same / x best: relative error 0.38" in text
    # the same error bound is relative to vitkit's own: a peer as close to fp32 as vitkit stays
    rows = [
        _row("vitkit-fast [int8]", "vitkit-fast", "int8", 24.4, 0.12, 0.8),
        _row("openvino [int8]", "openvino", "int8", 34.7, 0.15, 0.8),
    ]
    add_ratios(rows)
    assert "left_out" not in rows[1] and rows[0]["peer_best"] == "openvino [int8]"
