"""ONNX export through torch's dynamo exporter, validated against onnxruntime.

The exported graph takes ``images`` (B, C, H, W) at the model's native resolution and returns ``logits``
(B, K), or the representation (B, R) for a model without head. Fused attention (SDPA) and the hybrid stem's
"SAME" padding export as standard ONNX ops. Validation runs the file in onnxruntime on random inputs and
compares with the PyTorch model.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitkit.errors import VitkitError
from vitkit.fileio import write_file_atomic
from vitkit.hub.resolve import quiet_logs
from vitkit.models.vit import VisionTransformer
from vitkit.output_paths import check_output_file

DEFAULT_OPSET = 18


@dataclass(frozen=True)
class OnnxCheck:
    """How closely onnxruntime reproduces the PyTorch model on random inputs."""

    path: Path
    batch_sizes: tuple[int, ...]
    max_abs_err: float
    rel_err: float  # ||onnx - torch|| / ||torch|| over all checked outputs


def export_onnx(
    model: VisionTransformer,
    path: str | os.PathLike[str],
    *,
    dynamic_batch: bool = False,
    opset: int = DEFAULT_OPSET,
    batch_size: int = 2,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (eval mode, native resolution) as an ONNX file; ``dynamic_batch`` frees the batch axis.

    An existing file is replaced only with ``overwrite``. ``metadata``: key/value strings stored in the model's
    ``metadata_props`` (vitkit writes ``class_names`` and ``preprocess`` as JSON there; onnxruntime exposes them
    as ``session.get_modelmeta().custom_metadata_map``)."""
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter needs it)
    except ImportError:
        raise VitkitError(
            "ONNX export needs the 'onnx' and 'onnxscript' packages: pip install 'vitkit[onnx]'"
        ) from None
    model = model.eval()
    out = Path(path)
    check_output_file(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randn(batch_size, model.cfg.in_channels, *model.cfg.image_size)
    dynamic = {"x": {0: torch.export.Dim("batch", min=1)}} if dynamic_batch else None
    output = "logits" if model.cfg.num_classes > 0 else "features"
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            model,
            (x,),
            dynamo=True,
            input_names=["images"],
            output_names=[output],
            dynamic_shapes=dynamic,
            opset_version=opset,
            verbose=False,
        )
    if program is None:
        raise VitkitError(f"{out}: the ONNX exporter produced no program")
    if metadata:
        program.model.metadata_props.update(metadata)
    # never through a link; the mode of every checkpoint file vitkit writes; external data (a model past 2 GB,
    # "NAME.data" beside it) moved beside ``out`` with it
    return write_file_atomic(out, lambda tmp: program.save(str(tmp)))


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter prints progress on stdout and logs optional-op skips; keep the CLI's output clean."""
    with quiet_logs("torch.onnx"), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def validate_onnx(
    model: VisionTransformer, path: str | os.PathLike[str], batch_sizes: tuple[int, ...] = (2,), seed: int = 0
) -> OnnxCheck:
    """Run the ONNX file in onnxruntime and compare with ``model`` on random images."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise VitkitError("validating ONNX needs onnxruntime: pip install 'vitkit[onnx]'") from None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    gen = torch.Generator().manual_seed(seed)
    diffs, refs = [], []
    model = model.eval()
    for b in batch_sizes:
        x = torch.randn(b, model.cfg.in_channels, *model.cfg.image_size, generator=gen)
        with torch.no_grad():
            ref = model(x).float().numpy()
        got = session.run(None, {name: x.numpy()})[0]
        diffs.append((got - ref).ravel())
        refs.append(ref.ravel())
    d, r = np.concatenate(diffs), np.concatenate(refs)
    return OnnxCheck(Path(path), batch_sizes, float(np.abs(d).max()), float(np.linalg.norm(d) / np.linalg.norm(r)))
