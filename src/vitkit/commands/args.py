"""What the command modules share: the one-line-error parser, argument types, and option groups."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("vitkit predict: error: ... (see --help)")."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class IntermixedParser(Parser):
    """A subcommand parser whose file list may come before or after options (``cmd CKPT --opt x a.jpg b.jpg``).

    argparse's intermixed parsing calls ``parse_known_args`` again internally; the flag routes those inner
    calls to the plain parser.
    """

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def parsed(text: str, convert: Callable[[str], T], invalid: str) -> T:
    """``convert(text)`` for an argument type; argparse's error ``invalid`` when it raises ValueError."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(invalid) from None


def image_size(text: str) -> tuple[int, int]:
    """ "224" -> (224, 224); "224x320" -> (224, 320)."""
    invalid = f"invalid image size {text!r} (use 224 or 224x320)"
    parts = parsed(text, lambda t: [int(p) for p in t.lower().split("x")], invalid)
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(invalid)
    return parts[0], parts[1]


def _int_from(text: str, least: int) -> int:
    value = parsed(text, int, f"invalid integer {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'positive' if least else '0 or more'}, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    return _int_from(text, 0)


def positive_int(text: str) -> int:
    return _int_from(text, 1)


def worker_count(text: str) -> int:
    """``--workers``: 0 up to :func:`vitkit.hardware.max_workers` (a few per core of this machine)."""
    from vitkit.hardware import WORKERS_PER_CORE, max_workers

    value, most = nonnegative_int(text), max_workers()
    if value > most:
        raise argparse.ArgumentTypeError(
            f"at most {most} worker processes on this machine ({WORKERS_PER_CORE} per core), got {value}"
        )
    return value


def class_count(text: str) -> int:
    """``--num-classes``: 0 (no head) up to the most classes a head may have."""
    from vitkit.models.vit import MAX_CLASSES

    value = nonnegative_int(text)
    if value > MAX_CLASSES:
        raise argparse.ArgumentTypeError(f"at most {MAX_CLASSES} classes, got {value}")
    return value


def note_emulated_bf16(device: str | None, advice: str) -> None:
    """Say so (one "note:" line on stderr) when bf16 will run on a CPU that has no bf16 instructions, where
    PyTorch emulates bf16 matmuls; ``device`` as the command will resolve it ("auto" too), ``advice`` the
    command's fast choice."""
    from vitkit.hardware import has_native_bf16, resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cpu" and not has_native_bf16(resolved):
        print(
            "note: --precision bf16: this CPU has no bf16 instructions, so PyTorch emulates bf16 matmuls "
            f"(tens of times slower than fp32); {advice}",
            file=sys.stderr,
        )


def positive_float(text: str, allow_zero: bool = False) -> float:
    value = parsed(text, float, f"invalid number {text!r}")
    if not (value >= 0 if allow_zero else value > 0) or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be {'non-negative' if allow_zero else 'positive'}, got {text}")
    return value


def add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", help="input checkpoint format, if detection should be overridden")
    p.add_argument("--image-size", type=image_size, help="new resolution, e.g. 384 or 384x512 (resamples pos-emb)")
    p.add_argument(
        "--pos-interpolation",
        choices=["bilinear", "bicubic"],
        default="bilinear",
        help="position-embedding resampling for --image-size: bilinear = official interpolate_posembed "
        "(scipy zoom order 1, default), bicubic = timm's resample_abs_pos_embed (antialiased)",
    )


def add_checkpoint_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument(
        "checkpoint", nargs="?" if optional else None,
        help="checkpoint: a vitkit folder or run folder, a Google .npz, ... (any format)",
    )  # fmt: skip
    p.add_argument("--format", help="checkpoint format, if detection should be overridden")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps or auto (default: auto)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass (default %(default)s)")
    w = p.add_mutually_exclusive_group()
    w.add_argument(
        "--ema", dest="weights", action="store_const", const="ema", default="default",
        help="a training run: use the EMA (Polyak-averaged) weights of its latest checkpoint "
        "(default: the run's model/, which holds the EMA weights when the run used EMA)",
    )  # fmt: skip
    w.add_argument(
        "--no-ema", dest="weights", action="store_const", const="raw",
        help="a training run: use the raw, non-averaged weights of its latest checkpoint",
    )  # fmt: skip


def add_data_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--data",
        required=required,
        help="dataset: 'digits', an ImageFolder root, a CIFAR python folder, an .npz, or WebDataset shards",
    )
    add_workers_arg(p)
    p.add_argument("--skip-bad", action="store_true", help="skip unreadable images instead of failing")


def add_workers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=worker_count,
        help="image-decoding worker processes; 0 decodes in the main process (default: one per 4 cores, at least 1)",
    )


LOCAL_RAY = "local"  # --ray without an address: a Ray cluster on this machine, for the job


def ray_address(text: str) -> str:
    """``--ray ADDRESS``: ``auto``, ``host:port`` or ``ray://host:port`` (a word like an image path is not one:
    ``--ray`` took the argument after it)."""
    if text in ("auto", LOCAL_RAY) or ":" in text:
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Ray address (auto, HOST:PORT or ray://HOST:PORT); give --ray alone after the images"
    )


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray (pip install 'vitkit[ray]'; docs/ray.md)")
    g.add_argument(
        "--ray", nargs="?", const=LOCAL_RAY, type=ray_address, metavar="ADDRESS",
        help="run the job on a Ray cluster: decoding as Ray tasks, the model in a pool of actors, the same output "
        "written here (ADDRESS: auto for the running cluster, HOST:PORT or ray://HOST:PORT; none: a local cluster)",
    )  # fmt: skip
    g.add_argument("--actors", type=positive_int, default=1, help="with --ray: model actors (default 1)")
    g.add_argument(
        "--gpus-per-actor", type=float, default=0.0, help="with --ray: GPUs each model actor holds (default 0)"
    )


def ray_steps(args: argparse.Namespace) -> Any:
    """What runs a batch job's steps with ``--ray`` (:func:`vitkit.ray.steps`); None without it: the local loop."""
    if args.ray is None:
        return None
    from vitkit.ray import RayOptions, steps

    address = None if args.ray == LOCAL_RAY else args.ray
    return steps(RayOptions(address=address, actors=args.actors, gpus_per_actor=args.gpus_per_actor))


def add_decode_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--decode",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="where JPEGs are decoded: cpu (the workers), gpu (batched on the job's CUDA device with nvImageCodec, "
        "then resized there; pip install 'vitkit[gpu]'), auto (default: gpu where it is installed, the job runs on "
        "CUDA and a sample of the input decodes faster there)",
    )


def resolve_workers(workers: int | None, device: Any = "auto", backend: str = "torch") -> int:
    """``--workers`` as given, or the default for this machine and where the engine on ``backend`` runs on
    ``device`` (a name or a torch.device; "auto": a GPU where there is one; the ONNX engines: the CPU, by the
    policy's one rule :func:`vitkit.inference.policy.engine_device`), see
    :func:`vitkit.data.stream.default_workers`."""
    from vitkit.data.stream import default_workers
    from vitkit.inference.policy import engine_device

    return default_workers(gpu=engine_device(backend, device).type == "cuda") if workers is None else workers


def add_job_args(p: argparse.ArgumentParser, *, backend: bool = True) -> None:
    """What a batch job over images (predict, embed) runs on: ``--batch-size``, the engine's options (``--backend``
    where it has one), ``--workers``, ``--decode`` and the Ray options."""
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per forward pass (default 32)")
    add_engine_args(p, backend=backend)
    add_workers_arg(p)
    add_decode_arg(p)
    add_ray_args(p)


def add_engine_args(p: argparse.ArgumentParser, *, backend: bool = True, device: bool = True) -> None:
    """``--precision`` (and ``--backend``, ``--device``) of the inference engine a job runs on."""
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "int8", "fp8"],
        default="auto",
        help="auto (default): the fastest path that computes the model's function up to rounding -- bf16 where "
        "bf16 matmuls are native and measured faster than fp32, else the fp32 fast path; fp32: the checkpoint's own "
        "model, exactly as earlier versions computed; bf16; int8: dynamically quantised linear layers (CPU); fp8: "
        "the blocks' linear layers as fp8 GEMMs (GPUs of compute capability 8.9+: Ada, Hopper)",
    )
    if backend:
        p.add_argument(
            "--backend",
            choices=["torch", "onnxruntime", "openvino", "auto"],
            default="torch",
            help="what runs the model: torch (vitkit's fast path, default), onnxruntime (fp32, int8), openvino (fp32, "
            "bf16, NNCF int8 calibrated on the input's images), auto (the fastest installed, measured at start-up); "
            "pip install 'vitkit[bench]'",
        )
    if device:
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps or auto (default: auto)")


def report_engine(engine: Any) -> None:
    """The engine a job runs on, printed once on stderr as a note: precision, path, backend, device, build time."""
    print(f"note: engine: {engine.describe()}", file=sys.stderr, flush=True)


def print_notes(notes: Iterable[str | None], *, names_files: bool = False) -> None:
    """Each note given (None skipped) as a "note:" line on stderr; ``names_files``: notes that name a file, made
    :func:`~vitkit.textids.printable` (a name can neither drive the terminal nor break the line)."""
    from vitkit.textids import printable

    for note in notes:
        if note is not None:
            print(f"note: {printable(note) if names_files else note}", file=sys.stderr)


def load_checkpoint_args(args: argparse.Namespace, image_size: tuple[int, int] | None = None) -> Any:
    from vitkit.evaluate.weights import load_for_eval

    loaded, note = load_for_eval(args.checkpoint, format=args.format, weights=args.weights, image_size=image_size)
    if note:
        print(f"note: {args.checkpoint}: {note}", file=sys.stderr)
    return loaded


def join_processes(device: str | None) -> Any:
    """This process's place in a ``torchrun`` job (:func:`vitkit.distributed.setup`; one process: world 1, on
    ``device``). The batch jobs shard their input over the processes; process 0 writes and prints."""
    from vitkit.distributed import setup

    return setup(device or "auto")


def leave_processes(info: Any) -> None:
    """The end of a job under ``torchrun``: every process waits for the others (process 0 has written the output).
    The process group itself stays until the process exits, so that a process running several jobs (a script
    calling the commands in turn) joins it once: destroying and forming it again in one process reuses the
    rendezvous store's keys."""
    from vitkit.distributed import barrier

    barrier(info)


def finish_job(info: Any, summary: Any) -> bool:
    """The end of a batch job (predict, embed): every process waits for the others (:func:`leave_processes`), then
    process 0 prints the summary's decoding and failure notes. Whether this is process 0, which reports the rest."""
    leave_processes(info)
    if info.is_main:
        print_notes((summary.decode_note, summary.failure_note()), names_files=True)
    return bool(info.is_main)


def check_out_of_inputs(out: Any, *inputs: Any) -> None:
    """Refuse an ``--out`` that is, holds or lies inside a local input (an image folder or file, a ``--data``
    folder or file): written there, it would be read back as data by the next run on that input (predictions.csv
    in a folder of images; a report folder taken for a class). ``inputs``: paths, lists of paths, or None; only
    those that exist here are judged (names such as ``digits`` or a Hub id are no paths)."""
    import os
    from pathlib import Path

    from vitkit.errors import ConfigError
    from vitkit.output_paths import overlaps

    for item in inputs:
        for src in item if isinstance(item, (list, tuple)) else [item]:
            if src is not None and os.path.exists(src) and overlaps(Path(out), Path(src)):
                raise ConfigError(
                    f"--out {out}: is, holds or lies inside the input {src}, which is read as data (the output would "
                    "be read as input by the next run on it); write it outside the input"
                )
