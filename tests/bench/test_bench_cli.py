"""`vitkit bench` end to end on tiny configurations (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitkit import hardware
from vitkit.cli import main


def test_bench_compare_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "Ti/16", "--image-size", "32", "--batch-size", "2", "--repeats", "2", "--compare", "transformers"]
    assert main([*argv, "--precision", "bf16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vitkit-fast [bf16]" in text and "transformers [bf16]" in text and "peak bf16" in text
    result = json.loads(out.read_text())
    rows = {r["runner"]: r for r in result["results"]}
    fast, peer = rows["vitkit-fast [bf16]"], rows["transformers [bf16]"]
    assert fast["speedup_vs_peer_same_precision"] == pytest.approx(fast["img_per_s"] / peer["img_per_s"])
    # 32 px, patch 16: 4 patches + class token; attention's T^2 products over all matrix products (cost_table)
    D, L, T = 192, 12, 5
    assert result["tokens"] == T
    assert result["attention_n2_share"] == pytest.approx(L * 2 * T * T * D / (result["gflops"] * 1e9 / 2))


@pytest.mark.parametrize("native", [True, False])
def test_bench_default_precision_is_bf16_only_with_bf16_hardware(
    native: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": native)
    argv = ["bench", "Ti/16", "--image-size", "32", "--batch-size", "2", "--repeats", "1", "--no-latency"]
    assert main([*argv, "--no-fast"]) == 0
    assert ("vitkit [bf16]" if native else "vitkit [fp32]") in capsys.readouterr().out


@pytest.mark.parametrize("native", [True, False])
def test_bench_train_default_precision_is_autocast_with_bf16_hardware(
    native: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A training step has no pure-bf16 runner: without --precision it was refused wherever bf16 is native (every
    CUDA GPU, CPUs with AVX512_BF16)."""
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": native)
    argv = ["bench", "Ti/16", "--image-size", "32", "--batch-size", "2", "--repeats", "1", "--no-latency"]
    assert main([*argv, "--task", "train"]) == 0
    assert ("[bf16-autocast]" if native else "[fp32]") in capsys.readouterr().out


def test_bench_sweep_plots_the_cost_curve(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "curve.png"
    argv = ["bench", "Ti/16", "--image-size", "32", "48", "--batch-size", "2", "--repeats", "1", "--no-latency"]
    assert main([*argv, "--precision", "fp32", "--plot", str(png), "--json", str(tmp_path / "s.json")]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    sweep = json.loads((tmp_path / "s.json").read_text())
    assert [r["spec"]["image_size"] for r in sweep] == [32, 48]
    assert sweep[1]["attention_n2_share"] > sweep[0]["attention_n2_share"]  # the T^2 term grows with size


def test_bench_user_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "Ti/16", "--task", "train", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitkit bench: error:") and "\n" not in err
