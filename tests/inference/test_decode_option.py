"""``--decode`` in the batch jobs (issue 31, section 2), with CUDA and nvImageCodec faked: the job picks the
decoder the option, the device and the installation say; with ``gpu`` its workers send JPEG bytes and the engine's
feed decodes them on the (faked) device, giving the rows of ``--decode cpu`` up to a pixel level of rounding;
refusals are one line, exit 2."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import run_cli, tiny_checkpoint
from vitkit import hardware
from vitkit.data.gpu_decode import GpuDecoder, GpuDecodeTransform
from vitkit.data.stream import FileSource, list_inputs
from vitkit.inference import jobs
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.policy import plan_engine

predict_module: Any = importlib.import_module("vitkit.inference.predict")
sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from test_gpu_decode import fake_nvimgcodec  # noqa: E402

CLASSES = ["cat", "dog", "ship", "car"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), CLASSES)


def photos(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng(i)
        small = rng.integers(0, 256, (8, 10, 3), dtype=np.uint8)
        Image.fromarray(small).resize((80, 60), Image.Resampling.BILINEAR).save(folder / f"{i:03d}.jpg", quality=92)
    Image.open(folder / "000.jpg").save(folder / "zz.png")
    return list_inputs([folder])


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """nvImageCodec importable (the fake, decoding with Pillow); returns its call log."""
    log: list[Any] = []
    fake = fake_nvimgcodec(log)
    nvidia = types.ModuleType("nvidia")
    nvidia.nvimgcodec = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    return log


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA available; streams and events that do nothing; copies to CUDA stay on the CPU; the GPU decoder made
    for CUDA computes on the CPU."""

    class Event:
        def record(self, stream: Any) -> None: ...

        def synchronize(self) -> None: ...

    class Stream:
        def __init__(self, device: Any = None) -> None: ...

        def wait_event(self, event: Any) -> None: ...

    to = torch.Tensor.to

    def fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device | str) and torch.device(device).type == "cuda":
            return self
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(jobs, "GpuDecoder", lambda pre, module, dev: GpuDecoder(pre, module, torch.device("cpu")))


def cuda_engine(loaded: Any, **kw: Any) -> InferenceEngine:
    engine = InferenceEngine(loaded.model, loaded.meta.preprocess, labels=CLASSES, precision="fp32", device="cpu")
    engine.device = torch.device("cuda", 0)
    return engine


def test_the_job_plans_the_decoder_the_option_device_and_installation_say(
    tmp_path: Path, ckpt: Path, installed: list[Any], fake_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = photos(tmp_path / "in", 3)
    pre = vitkit.load_checkpoint(ckpt).meta.preprocess
    from vitkit.data.eval_transform import EvalTransform

    t = EvalTransform(pre, uint8=True)
    src = FileSource(files)
    gpu_plan, cpu_plan = plan_engine("bf16", "torch", "cuda"), plan_engine("bf16", "torch", "cpu")
    same, none = jobs.plan_decode("cpu", t, gpu_plan, src, range(3), 2)
    assert same is t and none is None
    wt, dec = jobs.plan_decode("gpu", t, gpu_plan, src, range(3), 2)
    assert isinstance(wt, GpuDecodeTransform) and wt.cpu == t and dec is not None
    assert not installed  # the decoder is made when the job asks for it (after the engine), not before
    assert dec() is dec() and len(installed) == 1
    wt, dec = jobs.plan_decode("auto", t, cpu_plan, src, range(3), 2)  # a CPU job: the workers decode
    assert wt is t and dec is None and len(installed) == 1
    measured: list[Any] = []

    def faster(gpu: bool) -> Any:
        return lambda *a: (measured.append(a[1]), jobs_rates(gpu))[1]

    def jobs_rates(gpu: bool) -> Any:
        from vitkit.data.gpu_decode import DecodeRates

        return DecodeRates(cpu=1.0, gpu=2.0 if gpu else 0.5)

    monkeypatch.setattr(jobs, "measure_rates", faster(True))
    wt, dec = jobs.plan_decode("auto", t, gpu_plan, src, range(3), 2)
    assert isinstance(wt, GpuDecodeTransform) and list(measured[-1]) == [0, 1, 2]
    monkeypatch.setattr(jobs, "measure_rates", faster(False))
    wt, dec = jobs.plan_decode("auto", t, gpu_plan, src, range(3), 2)
    assert wt is t and dec is None
    ref = EvalTransform(pre, reference=True)
    assert jobs.plan_decode("auto", ref, gpu_plan, src, range(3), 2) == (ref, None)
    with pytest.raises(vitkit.errors.ConfigError, match=r"^--decode gpu: --precision fp32 is the reference"):
        jobs.plan_decode("gpu", ref, gpu_plan, src, range(3), 2)
    for transform in (t, ref):  # an unknown value: refused first, by the job's one check (choose_decode has none)
        with pytest.raises(vitkit.errors.ConfigError, match=r"^--decode 'nvjpeg': choose one of cpu, gpu, auto$"):
            jobs.plan_decode("nvjpeg", transform, gpu_plan, src, range(3), 2)


def test_predict_job_decoding_on_the_gpu_gives_the_rows_of_the_cpu_decode(
    tmp_path: Path, ckpt: Path, installed: list[Any], fake_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = photos(tmp_path / "in", 7)  # 7 JPEGs and a PNG (decoded by the workers)
    loaded = vitkit.load_checkpoint(ckpt)
    monkeypatch.setattr(jobs.EngineSpec, "build", lambda spec, *a: cuda_engine(loaded))  # the job plans, then builds
    opts = predict_module.PredictOptions(batch_size=3, precision="bf16", device="cuda", workers=1, progress=False,
                                         logits=True, decode="cpu")  # fmt: skip
    cpu = predict_module.predict_job(loaded, FileSource(files), opts, out=tmp_path / "cpu.jsonl")
    assert cpu.decode_note is None and not installed
    gpu = predict_module.predict_job(
        loaded, FileSource(files), dataclasses.replace(opts, decode="gpu"), out=tmp_path / "gpu.jsonl"
    )
    assert gpu.decode_note == (
        "--decode gpu: 7 of 8 image(s) decoded on the GPU; on the CPU: 1 not GPU-decodable (not colour JPEGs, or "
        "too large)"
    )
    assert [c[1] for c in installed if c[0] == "decode"] == [3, 3, 1]  # one call per batch (the PNG is last)
    rows = [[json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("cpu", "gpu")]
    assert [r["image"] for r in rows[0]] == [r["image"] for r in rows[1]] == files
    a, b = (np.array([r["logits"] for r in rs]) for rs in rows)
    # the workers decode these 80x60 JPEGs at 1/2 scale, the GPU at full scale: the same pixels within resampling
    # error, so the same logits within a small tolerance (exactly the same for the PNG, decoded by the workers)
    assert files[-1].endswith(".png") and np.array_equal(a[-1], b[-1])
    assert 0 < np.abs(a - b).max() < 0.05


def test_decode_gpu_refusals_are_one_line_exit_2(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = photos(tmp_path / "data" / "test" / "cat", 2)
    for c in CLASSES[1:]:
        photos(tmp_path / "data" / "test" / c, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_cli(capsys, "predict", "-c", str(ckpt), *files, "--decode", "gpu", "--device", "cpu")
    assert code == 2 and err.strip().splitlines() == [
        "vitkit predict: error: --decode gpu: the model must run on a CUDA device (--device cuda, --backend torch)"
    ]
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--data", str(tmp_path / "data"), "--decode", "gpu",
                             "--out", str(tmp_path / "ev"))  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [
        "vitkit eval: error: --decode gpu: the model must run on a CUDA device (--device cuda, --backend torch)"
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": True)  # the plan asks (the GPU is faked)
    monkeypatch.setitem(sys.modules, "nvidia", None)  # not installed
    code, _, err = run_cli(capsys, "embed", str(ckpt), *files, "--out", str(tmp_path / "e.npy"), "--decode", "gpu",
                             "--device", "cuda")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("vitkit embed: error: --decode gpu: nvImageCodec is not installed or does not load; pip")
    code, _, err = run_cli(capsys, "predict", "-c", str(ckpt), *files, "--decode", "nvjpeg")
    assert code == 2 and "invalid choice: 'nvjpeg'" in err


def test_eval_with_decode_auto_on_the_cpu_is_the_cpu_decode(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str], installed: list[Any]
) -> None:
    """Installed, but the job runs on the CPU: auto leaves decoding to the workers, without asking nvImageCodec."""
    for c in CLASSES:
        photos(tmp_path / "data" / "test" / c, 2)
    code, out, _ = run_cli(capsys, "eval", str(ckpt), "--data", str(tmp_path / "data"), "--device", "cpu",
                             "--out", str(tmp_path / "ev"), "--json")  # fmt: skip
    assert code == 0 and not installed and "--decode gpu" not in out
