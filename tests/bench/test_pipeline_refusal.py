"""benchmarks/pipeline.py measures the pipeline, not the model: its child job, run as the script runs it (a real
subprocess over real JPEGs), gives a figure only where its no-op saw every image, as uint8 pixels on the GPU path;
with the engine left as it is (the real model runs) or the plan's ``feeds_gpu`` left as it is (the CPU path runs),
it is refused, exit non-zero, no figure (issue 42 item 5: on 320323f the patch missed and ~585 us/image of model
time were printed as the pipeline's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import SRC

SCRIPT = SRC.parent / "benchmarks" / "pipeline.py"
IMAGES = 6


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import vitkit
    from vitkit.models.vit import VisionTransformer, ViTConfig

    work = tmp_path_factory.mktemp("pipeline")
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        path = work / "photos" / "test" / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (75, 100, 3), dtype=np.uint8)).save(path, quality=90)
    cfg = ViTConfig(patch_size=32, hidden_size=32, depth=1, num_heads=1, mlp_dim=64, num_classes=2)
    vitkit.save_pretrained(VisionTransformer(cfg).eval(), work / "tiny", class_names=["c0", "c1"])
    return work / "photos", work / "tiny"


def child(mode: str, inputs: tuple[Path, Path], replace: str) -> subprocess.CompletedProcess[str]:
    folder, ckpt = inputs
    argv = ["--child", "job", mode, str(folder), str(ckpt), "4", "0", replace]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["eval", "predict-jsonl"])
def test_the_no_op_saw_every_image(job_inputs: tuple[Path, Path], mode: str) -> None:
    proc = child(mode, job_inputs, "all")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["images"] == IMAGES and got["main_thread_s"] > 0 and got["cpu_s"] >= got["main_thread_s"]


def test_the_real_model_running_is_refused(job_inputs: tuple[Path, Path]) -> None:
    proc = child("eval", job_inputs, "none")
    assert proc.returncode != 0 and proc.stdout == ""
    assert f"the no-op model saw 0 of {IMAGES} images" in proc.stderr and "no figure" in proc.stderr


def test_the_cpu_path_taken_for_the_gpu_path_is_refused(job_inputs: tuple[Path, Path]) -> None:
    proc = child("eval", job_inputs, "engine")
    assert proc.returncode != 0 and proc.stdout == ""
    assert f"{IMAGES} of {IMAGES} images reached the no-op as floats" in proc.stderr and "no figure" in proc.stderr
