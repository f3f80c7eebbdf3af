"""``vitkit serve CKPT``: an HTTP inference server with dynamic batching (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from vitkit.commands.args import note_emulated_bf16, positive_float, positive_int
from vitkit.errors import VitkitError

if TYPE_CHECKING:
    from vitkit.serve.served_model import ServedModel
    from vitkit.serve.similar import SimilarImages


def require_extra(*modules: str, extra: str = "serve") -> None:
    """A one-line error naming the install command when an optional dependency is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise VitkitError(
            f"this command needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'vitkit[{extra}]'"
        )


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint to serve (any format vitkit loads, or a run folder)")
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--threads", type=positive_int, help="CPU threads for the model (default: torch's, one per core)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def open_served(args: argparse.Namespace, **options: Any) -> tuple[ServedModel, SimilarImages | None]:
    """What ``serve`` and ``demo`` answer with, from :func:`add_model_options`' options: the checkpoint as a
    :class:`~vitkit.serve.ServedModel` (with the command's ``options``) on ``--threads`` CPU threads, and ``--index``'s
    :class:`~vitkit.serve.similar.SimilarImages` for it (None without ``--index``)."""
    import torch

    from vitkit.serve.served_model import ServedModel

    if args.threads:
        torch.set_num_threads(args.threads)
    served = ServedModel.from_checkpoint(args.checkpoint, format=args.format, device=args.device, **options)
    if options.get("precision") == "bf16":
        note_emulated_bf16(args.device, "--precision auto picks fp32 here")
    similar = None
    if args.index is not None:
        from vitkit.serve.similar import SimilarImages

        similar = SimilarImages.open(args.index, served)
    return served, similar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="HTTP inference server with dynamic batching (POST /predict, /search with --index, /health, /metrics, "
        "/model, /docs)",
        description="Serve a checkpoint over HTTP. Concurrent requests are gathered into one batch of up to "
        "--max-batch images, waiting at most --max-wait-ms after the oldest arrived, and run through the inference "
        "fast path. POST /predict takes raw image bytes or a multipart upload and answers the top-k labels as JSON "
        "(?attention=1 adds the attention rollout as a base64 PNG); GET /health, /metrics (Prometheus), /model "
        "(model card), /docs (OpenAPI); with --index, POST /search and GET /search?id= (similar images). SIGTERM "
        "or Ctrl-C stops accepting and finishes in-flight requests. Needs: pip install 'vitkit[serve]'.",
    )
    add_model_options(p)
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    _add_engine_options(p)
    _add_load_options(p)
    p.add_argument("--top-k", type=positive_int, default=5, help="labels per answer unless ?top_k= says (default 5)")
    p.add_argument(
        "--index",
        metavar="INDEX",
        help="a vitkit index (vitkit index) made with this checkpoint: adds POST /search (an image -> its nearest "
        "indexed images), GET /search?id= (an indexed image's neighbours) and GET /thumbnail?id= (a small JPEG of an "
        "indexed image, only files of the index); an index made by another checkpoint or preprocessing is refused "
        "at start-up",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """What runs the model: precision, backend, calibration."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "int8", "fp8"],
        default="auto",
        help="fast-path precision: auto = bf16 where the CPU has bf16 instructions (AVX512_BF16/AMX) or on CUDA, "
        "else fp32; int8 = dynamically quantised linear layers (CPU); fp8 = fp8 GEMMs (GPUs of compute capability "
        "8.9+)",
    )
    g.add_argument(
        "--backend",
        choices=["torch", "onnxruntime", "openvino", "auto"],
        default="torch",
        help="what runs the model: torch (vitkit's fast path, default), onnxruntime (fp32 or int8), openvino (fp32, "
        "bf16, NNCF int8), or auto (the fastest of those installed, measured at start-up); the engines run vitkit's "
        "ONNX export (pip install 'vitkit[bench]')",
    )
    g.add_argument(
        "--calibration",
        metavar="DIR",
        help="a folder of images like the ones you will serve (sub-folders too, e.g. an ImageFolder's classes; a "
        "large folder is sampled evenly) to calibrate OpenVINO's int8 (--backend openvino or auto with --precision "
        "int8); default: vitkit's bundled sample photos and digits",
    )


def _add_load_options(p: argparse.ArgumentParser) -> None:
    """Batching, admission, the size limits of an upload and the timeouts of a connection and a request."""
    g = p.add_argument_group("batching and admission")
    g.add_argument("--max-batch", type=positive_int, default=8, help="images per forward pass at most (default 8)")
    g.add_argument(
        "--max-wait-ms",
        type=lambda s: positive_float(s, allow_zero=True),
        default=5.0,
        help="longest a request waits for others to join its batch (default 5)",
    )
    g.add_argument(
        "--max-queue",
        type=positive_int,
        default=64,
        help="requests waiting at most (for the model, or being read or decoded); more get 503 before their upload "
        "is read (default 64)",
    )
    g.add_argument(
        "--max-decoding",
        type=positive_int,
        help="images decoded at once, each up to --max-pixels x 4 bytes and a copy in memory (default: one per CPU "
        "core, at most --max-queue)",
    )
    g = p.add_argument_group("limits and timeouts")
    g.add_argument("--max-upload-mb", type=positive_float, default=16.0, help="largest upload in MiB, 413 (default 16)")
    g.add_argument(
        "--max-pixels",
        type=positive_int,
        default=40_000_000,
        help="largest image in pixels, checked from the header before decoding, 413 (default 40000000)",
    )
    g.add_argument("--timeout", type=positive_float, default=30.0, help="request timeout in seconds, 504 (default 30)")
    g.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a connection may take to send a whole request head, from opening or from its last answer; "
        "then it is closed (idle connections never hold the server; default 10)",
    )
    g.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request's body may take to arrive, from the end of its head, however slowly it trickles in; "
        "then 408 and the connection is closed (default 30)",
    )
    g.add_argument(
        "--decode-timeout",
        type=positive_float,
        default=10.0,
        help="seconds an image may take to decode (each is decoded in a worker process); then the process is "
        "killed and the request answered 413, so a decoder bomb never holds a decoding slot longer (default 10)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    require_extra("fastapi", "uvicorn", "prometheus_client", "multipart")
    import uvicorn

    from vitkit.data.folder import list_image_files
    from vitkit.serve.app import create_app
    from vitkit.serve.net import bind, server_config
    from vitkit.serve.served_model import check_calibration_used, uses_calibration
    from vitkit.serve.server import ServeOptions

    sock = bind(args.host, args.port)  # a bad or taken port is one line here, before the model loads or any banner
    calibration = None
    if args.calibration is not None:  # a bad folder fails here, before the model is loaded
        check_calibration_used(args.backend, args.precision)
        calibration = list_image_files(args.calibration, "--calibration")
    elif uses_calibration(args.backend, args.precision):
        print(
            f"note: --backend {args.backend} --precision int8: OpenVINO's int8 is calibrated on vitkit's bundled "
            "sample photos and digits; --calibration DIR calibrates on images like the ones you will serve",
            file=sys.stderr,
        )
    opts = ServeOptions(
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        max_upload_bytes=int(args.max_upload_mb * (1 << 20)),
        max_pixels=args.max_pixels,
        top_k=args.top_k,
        max_decoding=args.max_decoding or 0,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        decode_timeout_s=args.decode_timeout,
    )
    served, similar = open_served(
        args, precision=args.precision, max_batch=args.max_batch, backend=args.backend, calibration=calibration
    )
    served.warm_up(args.max_batch)
    app = create_app(served, opts, similar)
    card = served.card()
    print(
        f"vitkit serve: {card['name']} ({card['num_classes']} classes, {card['image_size'][0]}x{card['image_size'][1]}"
        f" px, {served.engine.describe()}"
        + (f"; /search over {len(similar.index)} images" if similar is not None else "")
        + f") on http://{args.host}:{args.port}  (API docs: /docs)",
        file=sys.stderr,
        flush=True,
    )
    config = server_config(app, opts, host=args.host, port=args.port, log_level=args.log_level)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
