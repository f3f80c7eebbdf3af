"""The engines CPU users deploy on as ``vitkit bench --compare`` peers: ONNX Runtime and OpenVINO.

Both run vitkit's own ONNX export of the benchmarked model (``vitkit export``'s exporter, batch axis free),
built by :mod:`vitkit.inference.backends`, one runner per precision the engine has:

========== ================================================ ===========================================
precision  onnxruntime                                      openvino
========== ================================================ ===========================================
fp32       fp32                                             fp32 (``INFERENCE_PRECISION_HINT`` f32)
bf16       (no bf16 kernels on CPU)                         bf16 inference-precision hint
int8       ``quantize_dynamic`` (per-channel int8 weights)  NNCF post-training quantisation, calibrated
                                                            on the bench's real images; rest in bf16
========== ================================================ ===========================================

They alternate call by call with vitkit and transformers in the one process. Thread pools must not take
the cores from the next runner: ONNX Runtime gets ``intra_op_num_threads`` = torch's threads, one inter-op
thread and ``session.intra_op.allow_spinning=0``; OpenVINO gets ``INFERENCE_NUM_THREADS`` = torch's threads,
one stream, no core pinning. Measured after each call (BENCHMARKS.md): ONNX Runtime then burns no CPU,
OpenVINO's TBB workers under 1 ms, and torch's OpenMP workers ~10 ms of spinning; so with engines in the
run every timed call starts after ``SETTLE_S`` of idle time, when no pool spins any more.
"""

from __future__ import annotations

import tempfile

from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError, VitkitError
from vitkit.inference.backends import (
    ENGINES,
    EngineModel,
    engine_model,
    engine_precisions,
    export_for_engines,
    require_engine,
)
from vitkit.models.vit import VisionTransformer

SETTLE_S = 0.05  # idle time before each timed call when engines alternate with torch (its OpenMP spins ~10 ms)
CALIBRATION_IMAGES = 32  # NNCF calibration: the first real images of vitkit.bench.sample_images


def engines_in(compare: tuple[str, ...]) -> list[str]:
    """The CPU engines (ONNX Runtime, OpenVINO) among the peers of ``--compare``."""
    return [p for p in compare if p in ENGINES]


def check_engines(compare: tuple[str, ...], precisions: tuple[str, ...], task: str, device: str) -> None:
    """Fail before any measuring when an engine peer cannot run: a missing package (one line naming the
    extra), a training benchmark, or a GPU."""
    engines = engines_in(compare)
    if not engines:
        return
    if task != "inference" or device != "cpu":
        raise ConfigError(f"--compare {' '.join(engines)}: the engines are inference peers on the CPU")
    for e in engines:
        try:
            require_engine(e, int8="int8" in precisions)
        except VitkitError as err:
            raise VitkitError(f"--compare {e}: {err}") from None


def engine_models(
    compare: tuple[str, ...], precisions: tuple[str, ...], model: VisionTransformer, pre: Preprocess
) -> list[EngineModel]:
    """A model for every (engine, precision) asked for that the engine computes in, on one shared export."""
    wanted = [(e, p) for p in precisions for e in engines_in(compare) if p in engine_precisions(e)]
    if not wanted:
        return []
    calibration = None
    if ("openvino", "int8") in wanted:
        from vitkit.bench.sample_images import real_image_batch

        calibration = real_image_batch(pre)[:CALIBRATION_IMAGES]
    with tempfile.TemporaryDirectory(prefix="vitkit-bench-") as tmp:
        onnx_path = export_for_engines(model, tmp)
        return [engine_model(onnx_path, e, p, calibration=calibration) for e, p in wanted]
