"""How a batch job feeds a GPU (issue 31), tested with CUDA faked for the decisions and on a GPU where there is
one: uint8 batches in page-locked memory for a CUDA engine (never for the CPU), copied with ``non_blocking`` and
normalised on the device, the copy of batch n+1 issued before batch n is handed over, and rows made per batch
equal to the rows made image by image before."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin

import vitkit
from helpers import full_fp32, tiny_checkpoint
from vitkit.checkpoints.preprocess import Preprocess, normalize
from vitkit.data.eval_transform import EvalTransform, Normalizer
from vitkit.data.stream import FileSource, StreamBatch, list_inputs
from vitkit.inference import jobs
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.policy import plan_engine

predict_module: Any = importlib.import_module("vitkit.inference.predict")  # (the package exports the function)
CLASSES = ["cat", "dog", "ship", "car"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), CLASSES)


def jpegs(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(folder / f"{i:03d}.jpg", quality=90)
    return list_inputs([folder])


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """CUDA available, with streams and events that only record what is asked of them, and ``Tensor.to`` a
    CUDA device recording (shape, dtype, non_blocking) and leaving the tensor on the CPU: the decisions run,
    the arithmetic stays on the CPU. Returns the log."""
    log: list[Any] = []

    class Event:
        def record(self, stream: Any) -> None:
            log.append("event")

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.device = device

        def wait_event(self, event: Any) -> None:
            log.append("wait")

    to = torch.Tensor.to

    def fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device | str) and torch.device(device).type == "cuda":
            log.append(("to", tuple(self.shape), self.dtype, kwargs.get("non_blocking", False)))
            return self
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    return log


def cuda_engine(loaded: Any) -> InferenceEngine:
    """A real engine built on the CPU, then told that its device is CUDA (with ``fake_cuda``)."""
    engine = InferenceEngine(loaded.model, loaded.meta.preprocess, labels=CLASSES, precision="fp32", device="cpu")
    engine.device = torch.device("cuda", 0)
    return engine


# ---- decisions, CUDA faked --------------------------------------------------------------------------------


def test_only_a_cuda_engine_gets_uint8_batches(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    """The plan says whether the engine feeds a GPU; the job's transform follows it (uint8 for a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = [plan_engine("fp32", "torch", d) for d in ("cuda", "auto", torch.device("cuda", 1))]
    assert all(p.feeds_gpu for p in gpu)
    assert not plan_engine("fp32", "torch", "cpu").feeds_gpu
    assert not plan_engine("fp32", "onnxruntime", "auto").feeds_gpu  # the engines: the CPU, auto or not
    with pytest.raises(vitkit.errors.ConfigError, match=r"^--backend onnxruntime: the engines run on the CPU"):
        plan_engine("fp32", "onnxruntime", "cuda")
    loaded = vitkit.load_checkpoint(ckpt)
    assert jobs.EngineSpec.of(loaded, precision="fp32", device="cuda").transform().uint8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not plan_engine("fp32", "torch", "auto").feeds_gpu
    assert not jobs.EngineSpec.of(loaded, precision="fp32", device="auto").transform().uint8


def test_dataloader_pinning_reaches_the_stream_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader(pin_memory=True) pins a custom batch only through its pin_memory() method."""
    pinned: list[torch.Tensor] = []

    def fake_pin(t: torch.Tensor, *args: object) -> torch.Tensor:  # no accelerator here to pin for
        pinned.append(t.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).view(2, 3, 4, 4)
    batch = StreamBatch(np.array([0, 1]), ["a", "b"], np.array([-1, -1]), [None, None], images)
    out = dataloader_pin(batch)
    assert isinstance(out, StreamBatch) and out.images is pinned[0] and torch.equal(out.images, images)
    assert out.ids == batch.ids and out.positions is batch.positions


def test_a_cuda_engine_copies_non_blocking_and_normalises_on_the_device(fake_cuda: list[Any], ckpt: Path) -> None:
    loaded = vitkit.load_checkpoint(ckpt)
    engine = cuda_engine(loaded)
    pre = loaded.meta.preprocess
    u8 = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    x = engine.prepare(u8)
    assert fake_cuda == [("to", (2, 3, 16, 16), torch.uint8, True)]  # the uint8 pixels, asynchronously
    want = torch.stack([normalize(img.permute(1, 2, 0).numpy(), pre._mean, pre._std) for img in u8])
    assert x.dtype == torch.float32 and torch.equal(x, want)
    f = engine.prepare(want)  # float images (embed, serve) are copied as they are
    assert fake_cuda[-1] == ("to", (2, 3, 16, 16), torch.float32, True) and f is want


def test_feed_issues_the_copy_of_the_next_batch_before_handing_over_this_one(fake_cuda: list[Any], ckpt: Path) -> None:
    engine = cuda_engine(vitkit.load_checkpoint(ckpt))
    log: list[Any] = []
    prepare = engine.prepare
    engine.prepare = lambda x: (log.append(f"copy {int(x[0, 0, 0, 0])}"), prepare(x))[1]  # type: ignore[method-assign]

    def arriving() -> Iterator[StreamBatch]:
        for n in range(3):
            log.append(f"arrive {n}")
            images = torch.full((1, 3, 16, 16), n, dtype=torch.uint8)
            yield StreamBatch(np.array([n]), [str(n)], np.array([-1]), [None], images)

    for b in engine.feed(arriving()):
        log.append(f"compute {b.ids[0]}")
        assert b.images.dtype == torch.float32
    assert log == ["arrive 0", "copy 0", "arrive 1", "copy 1", "compute 0", "arrive 2", "copy 2", "compute 1",
                   "compute 2"]  # fmt: skip
    assert fake_cuda.count("wait") == 3 and fake_cuda.count("event") == 3  # each forward waits on its copy


def test_feed_on_the_cpu_passes_batches_through(ckpt: Path) -> None:
    engine = InferenceEngine.from_loaded(vitkit.load_checkpoint(ckpt), precision="fp32", device="cpu")
    batches = [StreamBatch(np.array([0]), ["a"], np.array([-1]), [None], torch.zeros(1, 3, 16, 16))]
    assert [b is batches[0] for b in engine.feed(iter(batches))] == [True]


def test_predict_job_on_cuda_takes_the_uint8_path_with_the_same_rows(
    fake_cuda: list[Any], ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CUDA (faked) the job's workers hand over uint8 batches (left in shared memory: pinning measured slower
    on an H100), which the engine copies and normalises: the rows are the CPU job's, bit for bit."""
    files = jpegs(tmp_path / "in", 7)
    loaded = vitkit.load_checkpoint(ckpt)
    opts = predict_module.PredictOptions(batch_size=3, precision="fp32", workers=1, progress=False, logits=True)
    predict_module.predict_job(loaded, FileSource(files), opts, out=tmp_path / "cpu.jsonl")
    assert not [e for e in fake_cuda if e[0] == "to"]  # the CPU job: nothing copied to a device

    asked: list[dict[str, Any]] = []
    stream_batches = jobs.stream_batches

    def recording(source: Any, transform: Any, batch_size: int, **kwargs: Any) -> Any:
        asked.append({"uint8": transform.uint8})
        return stream_batches(source, transform, batch_size, **kwargs)  # pageable: stream_batches does not pin

    monkeypatch.setattr(jobs, "stream_batches", recording)
    monkeypatch.setattr(jobs.EngineSpec, "build", lambda spec, *a: cuda_engine(loaded))  # the job plans, then builds
    cuda_opts = dataclasses.replace(opts, device="cuda")
    predict_module.predict_job(loaded, FileSource(files), cuda_opts, out=tmp_path / "cuda.jsonl")
    assert asked == [{"uint8": True}]  # pageable: the pinning thread measured slower
    # (the fake leaves tensors on the CPU, so forward() copies the normalised batch "again": not counted)
    copies = [e for e in fake_cuda if e[0] == "to" and e[2] == torch.uint8]
    assert [c[1][0] for c in copies] == [3, 3, 1] and all(c[3] for c in copies)  # every batch, non_blocking
    assert (tmp_path / "cuda.jsonl").read_bytes() == (tmp_path / "cpu.jsonl").read_bytes()


# ---- rows made per batch ----------------------------------------------------------------------------------


def rows_image_by_image(
    engine: InferenceEngine, batch: StreamBatch, top_k: int, *, logits: bool = False, errors: bool = False
) -> dict[str, list[Any]]:
    """prediction_columns as it was before issue 31 (78bcf52): a Python loop over the images."""
    n = len(batch)
    cols: dict[str, list[Any]] = {
        "index": batch.positions.tolist(), "image": list(batch.ids),
        "labels": [None] * n, "classes": [None] * n, "probs": [None] * n,
    }  # fmt: skip
    if logits:
        cols["logits"] = [None] * n
    if errors:
        cols["error"] = [e or "" for e in batch.errors]
    if batch.images.numel():
        out = engine.logits(batch.images)
        top_p, top_i = out.softmax(dim=-1).topk(min(top_k, engine.num_classes), dim=-1)
        rows = [j for j, e in enumerate(batch.errors) if e is None]
        for g, j in enumerate(rows):
            classes = top_i[g].tolist()
            cols["classes"][j] = classes
            cols["labels"][j] = [engine.label(c) for c in classes]
            cols["probs"][j] = top_p[g].tolist()
            if logits:
                cols["logits"][j] = out[g].tolist()
    return cols


@pytest.mark.parametrize("labels", [CLASSES, None])
def test_rows_made_per_batch_equal_the_rows_made_image_by_image(ckpt: Path, labels: list[str] | None) -> None:
    loaded = vitkit.load_checkpoint(ckpt)
    engine = InferenceEngine(loaded.model, loaded.meta.preprocess, precision="fp32", labels=labels)
    pre = loaded.meta.preprocess
    rng = np.random.default_rng(0)
    n = 6
    ids = [f"img{i}" for i in range(n)]
    for failed in ([], [1, 4], list(range(n))):
        errors = [f"img{i}: corrupt" if i in failed else None for i in range(n)]
        good = n - len(failed)
        images = torch.stack([normalize(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), pre._mean, pre._std)
                              for _ in range(good)]) if good else torch.empty(0)  # fmt: skip
        batch = StreamBatch(np.arange(10, 10 + n), ids, np.full(n, -1), errors, images)
        for top_k, logits, errs in ((3, False, False), (10, True, True), (1, True, False)):
            got = predict_module.prediction_columns(engine, batch, top_k, logits=logits, errors=errs)
            want = rows_image_by_image(engine, batch, top_k, logits=logits, errors=errs)
            assert json.dumps(got) == json.dumps(want)  # the same values, types and order
            assert all(type(a) is type(b) for k in want for a, b in zip(got[k], want[k], strict=True))


# ---- on a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_normalising_on_cuda_is_the_cpu_float_path_bit_for_bit() -> None:
    for pre in (Preprocess(), Preprocess(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))):
        arr = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, 5, 3)).copy()
        want = normalize(arr, pre._mean, pre._std)
        got = Normalizer(pre)(torch.from_numpy(arr).permute(2, 0, 1)[None].cuda())
        assert got.is_cuda and torch.equal(got[0].cpu(), want)


@pytest.mark.gpu
def test_predict_on_cuda_end_to_end_equals_the_cpu(ckpt: Path, tmp_path: Path) -> None:
    """``vitkit predict`` on CUDA with a decoding worker (uint8, pinned, side stream): the rows of the CPU run,
    logits to fp32 rounding (full fp32, no TF32); the Python API too."""
    files = jpegs(tmp_path / "in", 9)
    loaded = vitkit.load_checkpoint(ckpt)
    out: dict[str, list[dict[str, Any]]] = {}
    with full_fp32():
        for device in ("cpu", "cuda"):
            opts = predict_module.PredictOptions(batch_size=4, precision="fp32", workers=1, progress=False,
                                                 logits=True, device=device)  # fmt: skip
            path = tmp_path / f"{device}.jsonl"
            summary = predict_module.predict_job(loaded, FileSource(files), opts, out=path)
            assert summary.written == 9
            out[device] = [json.loads(line) for line in path.read_text().splitlines()]
        api = vitkit.predict(ckpt, files, device="cuda", workers=1, batch_size=4, top_k=2)
    for cpu, cuda in zip(out["cpu"], out["cuda"], strict=True):
        assert (cpu["index"], cpu["image"]) == (cuda["index"], cuda["image"])
        np.testing.assert_allclose(cuda["logits"], cpu["logits"], rtol=1e-4, atol=1e-5)
    assert [p.image for p in api] == files and all(len(p.top) == 2 for p in api)
    t = EvalTransform(loaded.meta.preprocess, uint8=True)
    assert t.uint8 and not EvalTransform(loaded.meta.preprocess).uint8
