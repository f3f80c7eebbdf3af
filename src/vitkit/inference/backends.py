"""Inference on the engines CPU users deploy on: ONNX Runtime and OpenVINO, through vitkit's own ONNX export.

``optimize_for_inference(model, ..., backend="onnxruntime" | "openvino" | "auto")`` lands here. The model is
exported once with :func:`vitkit.checkpoints.onnx_export.export_onnx` (batch axis free) and loaded into the
engine:

- ONNX Runtime: fp32, or int8 by ``onnxruntime.quantization.quantize_dynamic`` (int8 weights per output
  channel, uint8 activations quantised per call; the MatMuls, the patch convolution stays fp32). ONNX Runtime's
  CPU provider has no bf16 kernels.
- OpenVINO: fp32 or bf16 (the ``INFERENCE_PRECISION_HINT``), or int8 by NNCF post-training quantisation
  (``nncf.quantize`` with ``ModelType.TRANSFORMER``, calibrated on the images given), the ops it leaves in
  floating point in bf16 where the CPU has bf16 instructions.

Both engines get the thread count torch uses, one stream, and no busy-waiting after a call (ONNX Runtime:
``session.intra_op.allow_spinning=0``; OpenVINO's CPU plugin parks its TBB workers itself and is not pinned
to cores), so an engine sharing a process with torch does not take the cores from the next call.

The result is an ``nn.Module`` whose ``forward(images) -> logits`` takes a float (B, C, H, W) batch like the
model and returns float32 logits. ``"auto"`` builds every candidate the installed engines offer for the
precision, times them alternately on this machine and keeps the fastest (``.backend`` says which).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import importlib.util
import io
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitkit import hardware
from vitkit.checkpoints.onnx_export import export_onnx
from vitkit.errors import VitkitError
from vitkit.fileio import write_file_atomic
from vitkit.hub.resolve import quiet_logs
from vitkit.inference.policy import BACKENDS, fast_dtype
from vitkit.models.vit import VisionTransformer
from vitkit.timing import time_alternating

ENGINES = ("onnxruntime", "openvino")
_EXTRA = {"onnxruntime": ("onnxruntime", "onnx"), "openvino": ("openvino", "bench")}  # engine -> (module, extra)


def _missing(engine: str, int8: bool) -> list[str]:
    """The packages the engine needs that are not installed: the exporter's, the engine's, NNCF for
    OpenVINO's int8."""
    needs = ["onnxscript", _EXTRA[engine][0]] + (["nncf"] if engine == "openvino" and int8 else [])
    return [m for m in needs if importlib.util.find_spec(m) is None]


def engine_available(engine: str, int8: bool = False) -> bool:
    """Whether the engine's package (and, for its ONNX input, the exporter's; NNCF for OpenVINO's int8) is
    installed."""
    return not _missing(engine, int8)


def require_engine(engine: str, int8: bool = False) -> None:
    """A one-line error naming the extra to install when the engine (or what it needs) is missing."""
    missing = _missing(engine, int8)
    if missing:
        extra = _EXTRA[engine][1]
        raise VitkitError(
            f"backend {engine!r} needs {', '.join(missing)}, not installed: pip install 'vitkit[{extra}]'"
            + ("" if extra == "onnx" else " (or 'vitkit[onnx]' for ONNX Runtime alone)")
        )


def engine_precisions(engine: str) -> tuple[str, ...]:
    """The precisions an engine computes in on CPU (``fp32``, ``bf16``, ``int8``)."""
    return ("fp32", "int8") if engine == "onnxruntime" else ("fp32", "bf16", "int8")


class EngineModel(nn.Module):
    """A model running on an inference engine: ``forward(images (B, C, H, W)) -> logits (B, K)`` in float32.

    ``backend`` names the engine, ``precision`` what it computes in, ``detail`` how it was configured."""

    def __init__(self, backend: str, precision: str, run: Callable[[np.ndarray], np.ndarray], detail: str) -> None:
        super().__init__()
        self.backend, self.precision, self.detail = backend, precision, detail
        self._run = run

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(np.asarray(self._run(images), dtype=np.float32))

    def extra_repr(self) -> str:
        return f"backend={self.backend}, precision={self.precision}, {self.detail}"


def export_for_engines(model: VisionTransformer, folder: str | Path) -> Path:
    """The model as ONNX with a free batch axis, in ``folder`` (what every engine here reads)."""
    model = model.eval()
    if next(model.parameters()).device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        model = copy.deepcopy(model).to("cpu", torch.float32)
    return export_onnx(model, Path(folder) / "model.onnx", dynamic_batch=True, overwrite=True)


def without_initializer_shapes(onnx_path: Path, out: Path) -> Path:
    """A copy of the ONNX file at ``out`` without the ``value_info`` entries that repeat an initializer's shape
    (torch's exporter writes one for every weight); the initializers themselves still carry their shapes.

    ``quantize_dynamic`` of onnxruntime 1.19 to 1.28 (at least; not 1.32) turns ``Gemm(transB=1)`` (the
    classifier head) into a MatMul by transposing its weight in place, leaving the weight's value_info at the old
    shape; the shape inference it runs next (onnx's) then stops at the mismatch, "(192) vs (10)" for a Ti head of
    10 classes. Without the redundant entries there is nothing stale to disagree with, whatever the version.
    Weights stored as external data stay where they are (they are neither read nor rewritten)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    kept = [v for v in model.graph.value_info if v.name not in weights]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    return write_file_atomic(out, lambda tmp: onnx.save(model, str(tmp)))


def onnxruntime_model(onnx_path: Path, *, int8: bool = False, threads: int | None = None) -> EngineModel:
    """ONNX Runtime on the CPU: fp32, or dynamic int8 (``quantize_dynamic``, per-channel int8 weights).

    int8 quantises the MatMuls (every linear layer and the head, which onnxruntime turns from a Gemm into one)
    and leaves the patch embedding's convolution in fp32 (0.7% of B/16's multiply-adds): onnxruntime before 1.24
    has no ConvInteger kernel for int8 weights and refused the quantised file. On CPUs without VNNI the weights
    take 7 bits (``reduce_range``): AVX2's u8 x s8 multiply-adds saturate their 16-bit pair sums otherwise (0.38
    relative error against fp32 on a random Ti/16 on an AVX2-only EPYC, inside the 0.15 bound with 7 bits)."""
    require_engine("onnxruntime")
    import onnxruntime as ort

    path = onnx_path
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        source = without_initializer_shapes(onnx_path, onnx_path.with_name(onnx_path.stem + ".q-in.onnx"))
        path = onnx_path.with_name(onnx_path.stem + ".int8.onnx")
        with _quiet():  # its advice to pre-process first: measured, no faster and the same outputs here
            quantize_dynamic(  # 7-bit weights without VNNI: its u8 x s8 pairs saturate 16-bit sums (ORT's advice)
                source,
                path,
                weight_type=QuantType.QInt8,
                per_channel=True,
                reduce_range=not hardware.has_vnni(),
                op_types_to_quantize=["MatMul"],
            )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-wait after a call
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3  # warnings about unused initialisers are not the user's business
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(images: np.ndarray) -> np.ndarray:
        return session.run(None, {name: images})[0]

    detail = f"ONNX Runtime {ort.__version__}" + (", dynamic int8 (quantize_dynamic)" if int8 else ", fp32")
    return EngineModel("onnxruntime", "int8" if int8 else "fp32", run, detail)


def openvino_model(
    onnx_path: Path,
    *,
    precision: str = "bf16",
    threads: int | None = None,
    calibration: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> EngineModel:
    """OpenVINO's CPU plugin: ``precision`` fp32 or bf16 (the inference-precision hint), or int8 (NNCF
    post-training quantisation calibrated on ``calibration`` images (N, C, H, W); the rest in ``dtype``, the
    engine plan's, by default the policy's: bf16 where the CPU has bf16 instructions,
    :func:`vitkit.inference.policy.fast_dtype`)."""
    if precision not in ("fp32", "bf16", "int8"):
        raise ValueError(f"openvino precision must be fp32, bf16 or int8, got {precision!r}")
    require_engine("openvino", int8=precision == "int8")
    import openvino as ov

    with signal_stack_kept():  # OpenVINO swaps the thread's signal stack; see signal_stack_kept
        return _openvino_model(ov, onnx_path, precision, threads, calibration, dtype or fast_dtype(precision, "cpu"))


def _openvino_model(
    ov: Any, onnx_path: Path, precision: str, threads: int | None, calibration: torch.Tensor | None, dtype: torch.dtype
) -> EngineModel:
    core = ov.Core()
    ov_model = core.read_model(str(onnx_path))
    detail = f"OpenVINO {ov.get_version().split('-')[0]}"
    if precision == "int8":
        if calibration is None or calibration.shape[0] == 0:
            raise ValueError("openvino int8 (NNCF post-training quantisation) needs calibration images")
        ov_model = _nncf_int8(ov_model, calibration)
        detail += ", NNCF int8"
    floating = "bf16" if dtype == torch.bfloat16 else "fp32"
    config = {
        "INFERENCE_PRECISION_HINT": "bf16" if floating == "bf16" else "f32",
        "INFERENCE_NUM_THREADS": threads or torch.get_num_threads(),
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False,  # torch's threads share these cores: no pinning, no reservation
    }
    compiled = core.compile_model(ov_model, "CPU", config)
    # what the plugin took (f32 on CPUs without bf16), an element type: "<Type: 'bfloat16'>" (OpenVINO 2026.4)
    ran = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
    if floating == "bf16" and "bf16" not in ran and "bfloat16" not in ran:
        floating = "fp32 (this CPU has no bf16: OpenVINO computes in fp32)"
    request = compiled.create_infer_request()
    lock = threading.Lock()  # one infer request: one call at a time

    def run(images: np.ndarray) -> np.ndarray:
        with lock:
            request.infer({0: images})
            return request.get_output_tensor(0).data.copy()

    return EngineModel("openvino", precision, run, f"{detail}, {floating} inference precision")


class _SignalStack(ctypes.Structure):  # POSIX stack_t, as sigaltstack(2) reads and writes it (Linux)
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


@contextlib.contextmanager
def signal_stack_kept() -> Iterator[None]:
    """The calling thread's alternate signal stack (``sigaltstack``) as it was on entry, set again on exit.

    OpenVINO 2026.4's CPU plugin installs a signal stack of its own on the thread that compiles a model, and a
    freed model sets back the stack it saw when it was compiled, freeing its own. Two models freed in the order
    they were made therefore leave the thread on the first model's freed stack, and the next Python signal
    handler to run there (a DataLoader worker's SIGCHLD, Ctrl-C) crashes the process with a segfault. With the
    entry stack set again after compiling, every model remembers that one and gives it back, whatever the order
    (tests/inference/test_backends.py reproduces the crash). Linux only; elsewhere it does nothing."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    saved = _SignalStack()
    if libc is None or libc.sigaltstack(None, ctypes.byref(saved)) != 0:
        yield
        return
    try:
        yield
    finally:
        libc.sigaltstack(ctypes.byref(saved), None)


def _nncf_int8(ov_model: Any, calibration: torch.Tensor) -> Any:
    import nncf

    images = calibration.detach().to("cpu", torch.float32).numpy()
    items = [images[i : i + 1] for i in range(images.shape[0])]
    with _quiet():  # NNCF's progress bars and info lines stay off the command's output
        return nncf.quantize(
            ov_model, nncf.Dataset(items), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(items)
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence what the engines' tools print and log (warnings, progress bars) while they run."""
    with (
        quiet_logs("root", "nncf"),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        yield


def engine_model(
    onnx_path: Path,
    engine: str,
    precision: str,
    *,
    threads: int | None = None,
    calibration: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> EngineModel:
    """One engine at one precision on an exported file (see ``export_for_engines``); ``dtype``: OpenVINO int8's
    floating-point parts (the engine plan's; default the policy's)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if precision not in engine_precisions(engine):
        raise ValueError(f"{engine} computes in {' or '.join(engine_precisions(engine))} on CPU, not {precision}")
    if engine == "onnxruntime":
        return onnxruntime_model(onnx_path, int8=precision == "int8", threads=threads)
    return openvino_model(onnx_path, precision=precision, threads=threads, calibration=calibration, dtype=dtype)


def optimize_with_backend(
    model: VisionTransformer,
    dtype: torch.dtype,
    backend: str,
    int8: bool = False,
    batch_size: int | None = None,
    calibration: torch.Tensor | None = None,
    torch_candidate: Callable[[], nn.Module] | None = None,
    *,
    threads: int | None = None,
) -> nn.Module:
    """``optimize_for_inference``'s engines: ``backend`` "onnxruntime", "openvino", or "auto" (fastest of the
    torch fast path, given as ``torch_candidate``, and every installed engine that computes in the precision)."""
    if backend not in BACKENDS or backend == "torch":
        raise ValueError(f"backend must be one of {', '.join(b for b in BACKENDS if b != 'torch')}, got {backend!r}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU; the model is on {next(model.parameters()).device}")
    precision = "int8" if int8 else ("bf16" if dtype == torch.bfloat16 else "fp32")
    if backend == "auto":  # every installed engine computing in the precision; NNCF needs calibration images
        usable = [e for e in ENGINES if precision in engine_precisions(e) and engine_available(e, int8)]
        engines = [e for e in usable if not (e == "openvino" and int8 and calibration is None)]
    else:
        require_engine(backend, int8)
        if precision not in engine_precisions(backend):
            raise ValueError(f"{backend} computes in {' or '.join(engine_precisions(backend))} on CPU, not {precision}")
        engines = [backend]
    candidates: dict[str, nn.Module] = {}
    if backend == "auto" and torch_candidate is not None:
        with contextlib.suppress(ValueError):  # e.g. int8 without oneDNN: the engines may still offer it
            candidates["torch"] = torch_candidate()
    if engines:
        with tempfile.TemporaryDirectory(prefix="vitkit-engine-") as tmp:
            onnx_path = export_for_engines(model, tmp)
            for e in engines:
                candidates[e] = engine_model(
                    onnx_path, e, precision, threads=threads, calibration=calibration, dtype=dtype
                )
    if backend != "auto":
        return candidates[backend]
    if not candidates:
        raise ValueError("backend 'auto': no candidate (give the torch fast path or install an engine)")
    x = torch.randn(batch_size or 8, model.cfg.in_channels, *model.cfg.image_size)
    timings = time_candidates(candidates, x)
    best = min(timings, key=lambda k: timings[k])
    chosen = candidates[best]
    vars(chosen).update(backend=best, auto_timings=timings)  # the torch fast path is labelled too
    return chosen


def time_candidates(candidates: dict[str, nn.Module], x: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """Median seconds per call of each candidate on ``x``, after one warm-up call, the candidates alternating."""
    with torch.no_grad():
        for fn in candidates.values():
            fn(x)
        fns = {name: functools.partial(fn, x) for name, fn in candidates.items()}
        timings = time_alternating(fns, repeats, torch.device("cpu"), torch.get_num_threads())
    return {k: t.median for k, t in timings.items()}
