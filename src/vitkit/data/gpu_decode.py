"""JPEG decoding on the job's GPU (``--decode gpu``): the workers only read and check the files, and the job's
process decodes each batch's JPEGs at once with NVIDIA's nvImageCodec (nvJPEG; the optional extra
``vitkit[gpu]``), then resizes and crops them on the device.

- :class:`GpuDecodeTransform` runs in the workers: a JPEG that :func:`~vitkit.images.open_lazy`
  read and checked (a regular file under the byte cap, at most ``MAX_JPEG_SCANS`` scans, a header under the pixel
  limit, the preprocessing's size check) is handed over as its bytes (:class:`~vitkit.data.stream.EncodedImage`);
  anything else (PNG, greyscale or CMYK JPEGs, a greyscale model, an interpolation without an antialiased
  kernel, more than ``GPU_MAX_PIXELS`` pixels, a line of pixels whose crop the CPU resizes box-wise) is decoded
  there by the CPU path, as with ``--decode cpu``, and counted.
- :class:`GpuDecoder` runs in the job's process: one batched ``decode`` call per batch, then
  :func:`resize_crop` on the device (PyTorch's antialiased ``interpolate``, the CPU path's resize from the full
  decode: the reference's pixels within rounding, tests/data/test_gpu_decode.py), then the engine normalises
  as it does the workers' uint8 pixels. A JPEG nvImageCodec refuses is decoded on the CPU instead, counted; one
  that neither decodes is the CPU decoder's one-line DataError, as with ``--decode cpu``.

nvImageCodec is imported only when a job asks for it (:func:`nvimgcodec_module`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from vitkit.checkpoints.preprocess import TORCH_RESIZE, Preprocess
from vitkit.data.eval_transform import MAX_CROP_AMPLIFICATION, EvalTransform
from vitkit.data.stream import EncodedBatch, EncodedImage, ImageSource, StreamBatch, _pack
from vitkit.errors import ConfigError, DataError
from vitkit.images import EncodedJpeg, LazyImage

DECODES = ("cpu", "gpu", "auto")
# JPEGs of more pixels than this are decoded by the workers at reduced scale instead: a batch of 256 full-scale
# decodes stays under 256 x 24 MP x 3 B = 18 GB of device memory at worst (the header is checked in the worker)
GPU_MAX_PIXELS = 24_000_000
INSTALL_HINT = "pip install 'vitkit[gpu]' (nvidia-nvimgcodec-cu13 and nvidia-nvjpeg)"


def nvimgcodec_module() -> Any | None:
    """``nvidia.nvimgcodec`` when it is installed and imports, else None."""
    try:
        from nvidia import nvimgcodec  # type: ignore[import-not-found,unused-ignore]
    except (ImportError, OSError):
        return None
    return nvimgcodec


def gpu_decodable(pre: Preprocess, jpeg: EncodedJpeg) -> bool:
    """Whether ``jpeg`` goes to the GPU decoder for ``pre``: an RGB model, a colour JPEG, an interpolation
    PyTorch resizes with antialiasing, at most ``GPU_MAX_PIXELS``, and not a line of pixels whose centre crop
    the CPU path resizes box-wise (``MAX_CROP_AMPLIFICATION``)."""
    if pre.grayscale or jpeg.mode != "RGB" or pre.interpolation not in TORCH_RESIZE:
        return False
    if jpeg.width * jpeg.height > GPU_MAX_PIXELS:
        return False
    new_w, new_h, _, _ = pre.resize_target(jpeg.width, jpeg.height)
    H, W = pre.image_size
    return not (pre.resize != "squash" and new_w * new_h > MAX_CROP_AMPLIFICATION * H * W)


@dataclass(frozen=True)
class GpuDecodeTransform:
    """The workers' half of ``--decode gpu``: a checked JPEG -> its bytes (:class:`EncodedImage`); anything
    else -> ``cpu``'s uint8 pixels (see the module docstring). Picklable."""

    cpu: EvalTransform  # uint8=True, the fast path: what the workers compute for the rest
    lazy: ClassVar[bool] = True  # it wants JPEGs read and not decoded

    def __call__(self, img: LazyImage, name: str = "image") -> torch.Tensor | EncodedImage:
        pre = self.cpu.preprocess
        if isinstance(img, EncodedJpeg) and gpu_decodable(pre, img):
            pre.check_size(img.width, img.height, img.name)  # refused from the header, as on the CPU path
            return EncodedImage(img.data, img.width, img.height, img.name)
        return self.cpu(img, name)


def resize_crop(x: torch.Tensor, pre: Preprocess) -> torch.Tensor:
    """Full-scale decoded pixels (n, 3, h, w) uint8 of images of one size, on any device -> the model's
    (n, 3, H, W) uint8 pixels: resized as :meth:`Preprocess.resized` resizes (squash, or shorter side to size /
    crop_pct and the centre crop) by PyTorch's antialiased kernel in float32, one direction at a time and
    rounded to 0..255 after each, as Pillow does (bicubic overshoots: clipping only at the end moved a few
    pixels by 3-4 levels)."""
    H, W = pre.image_size
    h, w = x.shape[-2:]
    new_w, new_h, left, top = pre.resize_target(w, h)
    mode = TORCH_RESIZE[pre.interpolation]
    y = x.float()
    if w != new_w:  # Pillow's order: the horizontal pass first
        y = F.interpolate(y, size=(h, new_w), mode=mode, antialias=True).round_().clamp_(0, 255)
    if h != new_h:
        y = F.interpolate(y, size=(new_h, new_w), mode=mode, antialias=True).round_().clamp_(0, 255)
    return y[:, :, top : top + H, left : left + W].to(torch.uint8)


@dataclass
class DecodeCounts:
    """What decoded a job's images: ``gpu`` on the device, ``workers`` by the workers' CPU path (not
    GPU-decodable), ``refused`` by the CPU in the job's process after nvImageCodec refused them."""

    gpu: int = 0
    workers: int = 0
    refused: int = 0
    first_refused: str | None = None

    def note(self) -> str:
        total = self.gpu + self.workers + self.refused
        line = f"--decode gpu: {self.gpu} of {total} image(s) decoded on the GPU"
        if self.workers or self.refused:
            line += f"; on the CPU: {self.workers} not GPU-decodable (not colour JPEGs, or too large)"
            if self.refused:
                line += f", {self.refused} refused by nvImageCodec (first: {self.first_refused})"
        return line


@dataclass
class GpuDecoder:
    """The job's half of ``--decode gpu``: :meth:`images` of a batch on ``device``. ``module``: nvImageCodec
    (:func:`nvimgcodec_module`; tests pass a fake)."""

    preprocess: Preprocess
    module: Any
    device: torch.device
    counts: DecodeCounts = field(default_factory=DecodeCounts)

    def __post_init__(self) -> None:
        m = self.module
        kinds = [getattr(m.BackendKind, k, None) for k in ("GPU_ONLY", "HYBRID_CPU_GPU", "HW_GPU_ONLY")]
        backends = [m.Backend(k) for k in kinds if k is not None]  # never nvImageCodec's CPU-only decoders
        index = self.device.index if self.device.index is not None else 0
        self._codec = m.Decoder(device_id=index, backends=backends)
        # Pillow and libjpeg-turbo (the CPU path) ignore EXIF orientation; so must the GPU
        self._params = m.DecodeParams(color_spec=m.ColorSpec.SRGB, apply_exif_orientation=False)
        self._fallback = EvalTransform(self.preprocess, uint8=True)

    def images(self, batch: StreamBatch) -> tuple[torch.Tensor, list[Any]]:
        """The batch's decoded items (G, 3, H, W) uint8 on the device, in order: its ``images`` (the workers'
        pixels) copied there and its ``encoded`` JPEGs decoded there; and the decoder's outputs, which must
        live until the work queued on the device has used them."""
        enc = batch.encoded
        cpu = batch.images
        if enc is None:
            return cpu.to(self.device, non_blocking=True), []
        G = len(cpu) + len(enc) if cpu.numel() else len(enc)
        H, W = self.preprocess.image_size
        out = torch.empty((G, 3, H, W), dtype=torch.uint8, device=self.device)
        mine = np.zeros(G, dtype=bool)
        mine[enc.rows] = True
        if cpu.numel():
            out[torch.from_numpy(np.flatnonzero(~mine)).to(self.device)] = cpu.to(self.device, non_blocking=True)
            self.counts.workers += len(cpu)
        decoded = self._decode(enc)
        groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        for i, img in enumerate(decoded):
            if img is not None:
                groups.setdefault((int(img.shape[0]), int(img.shape[1])), []).append((i, img))
        for group in groups.values():  # images of one size resized at once
            idx = [i for i, _ in group]
            x = torch.stack([img for _, img in group]).permute(0, 3, 1, 2)
            out[torch.from_numpy(enc.rows[idx]).to(self.device)] = resize_crop(x, self.preprocess)
            self.counts.gpu += len(idx)
        for i, img in enumerate(decoded):
            if img is None:
                out[int(enc.rows[i])] = self._on_cpu(enc, i).to(self.device)
        return out, decoded

    def _decode(self, enc: EncodedBatch) -> list[torch.Tensor | None]:
        """One batched call; each result as an (h, w, 3) uint8 tensor on the device, None where nvImageCodec
        refused the image or gave other than its header's size in RGB."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        blobs = [enc.blob(i) for i in range(len(enc))]
        try:
            got = self._codec.decode(blobs, params=self._params, cuda_stream=stream)
        except Exception:  # nvImageCodec raises for a batch it cannot start: each image then on the CPU
            got = [None] * len(blobs)
        out: list[torch.Tensor | None] = []
        for i, img in enumerate(got):
            t = None if img is None else torch.as_tensor(img, device=self.device)
            w, h = (int(v) for v in enc.sizes[i])
            out.append(t if t is not None and tuple(t.shape) == (h, w, 3) and t.dtype == torch.uint8 else None)
        return out

    def _on_cpu(self, enc: EncodedBatch, i: int) -> torch.Tensor:
        """A JPEG nvImageCodec refused, decoded by the CPU path (its DataError naming the file if that fails too)."""
        name = enc.names[i]
        w, h = (int(v) for v in enc.sizes[i])
        self.counts.refused += 1
        if self.counts.first_refused is None:
            self.counts.first_refused = name
        x = self._fallback(EncodedJpeg(enc.blob(i).tobytes(), w, h, "RGB", name), name)
        assert isinstance(x, torch.Tensor)
        return x


# ---- choosing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRates:
    """Images a second over the same sample of a job's JPEGs: ``cpu`` the workers together (one process's
    rate times the workers), ``gpu`` the GPU decoder (decode, resize and crop, synchronised)."""

    cpu: float
    gpu: float

    @property
    def gpu_faster(self) -> bool:
        return self.gpu > self.cpu


AUTO_SAMPLE = 32  # JPEGs timed on each side for --decode auto


def measure_rates(
    source: ImageSource, positions: Sequence[int], cpu: EvalTransform, decoder: GpuDecoder, workers: int
) -> DecodeRates | None:
    """:class:`DecodeRates` over up to ``AUTO_SAMPLE`` of the job's first JPEGs (None when it has none that the
    GPU would decode): each side once untimed (the GPU's first call sets it up), then timed."""
    gpu_side = GpuDecodeTransform(cpu)
    items: list[tuple[LazyImage, EncodedImage, str]] = []
    for pos in positions[: 4 * AUTO_SAMPLE]:
        try:
            img, _ = source.load(pos, True)
            enc = gpu_side(img, source.item_id(pos))
        except DataError:
            continue
        if isinstance(enc, EncodedImage):
            items.append((img, enc, source.item_id(pos)))
        if len(items) == AUTO_SAMPLE:
            break
    if not items:
        return None
    batch = StreamBatch(
        positions=np.arange(len(items)), ids=[n for *_, n in items], labels=np.full(len(items), -1),
        errors=[None] * len(items), images=torch.empty(0), encoded=_pack([(k, e) for k, (_, e, _) in enumerate(items)]),
    )  # fmt: skip

    def gpu_once() -> None:
        decoder.images(batch)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize(decoder.device)

    def cpu_once() -> None:
        for img, _, name in items:
            cpu(img, name)

    rates = []
    for once in (cpu_once, gpu_once):
        once()
        start = time.perf_counter()
        once()
        rates.append(len(items) / max(time.perf_counter() - start, 1e-9))
    decoder.counts = DecodeCounts()  # the sample is not the job's
    return DecodeRates(cpu=rates[0] * max(1, workers), gpu=rates[1])


def choose_decode(
    decode: str,
    gpu_job: bool,
    *,
    module: Callable[[], Any | None] = nvimgcodec_module,
    rates: Callable[[], DecodeRates | None] = lambda: None,
) -> bool:
    """Whether a job decodes its JPEGs on the GPU: ``decode`` as the option says (``cpu``, ``gpu``, ``auto``),
    ``gpu_job`` whether its engine runs on a CUDA device (:attr:`vitkit.inference.policy.EnginePlan.feeds_gpu`).
    ``gpu`` without a CUDA job or without nvImageCodec is a ConfigError (one line). ``auto``: the GPU when
    nvImageCodec is installed, the job is on CUDA and ``rates()`` (:func:`measure_rates`, called only then)
    measures the GPU decoder faster than the workers; else the CPU."""
    if decode == "cpu":
        return False
    if decode == "gpu":
        if not gpu_job:
            raise ConfigError("--decode gpu: the model must run on a CUDA device (--device cuda, --backend torch)")
        if module() is None:
            raise ConfigError(f"--decode gpu: nvImageCodec is not installed or does not load; {INSTALL_HINT}")
        return True
    if not gpu_job or module() is None:
        return False
    measured = rates()
    return measured is not None and measured.gpu_faster
