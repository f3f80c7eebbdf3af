"""vitkit's batch jobs (``predict``, ``embed``) on a Ray cluster (extra ``vitkit[ray]``), through Ray Data.

The job is the local one (:mod:`vitkit.inference.jobs`): the same input listing, engine plan, task and output
store; only the loop that feeds the task changes. The driver lists the positions still to do and cuts them into
the local job's batches (``batch_size`` consecutive positions); then

- :class:`Decode` (Ray *tasks*, on any node's CPUs, retried when one raises) reads and transforms one batch
  with vitkit's own decoder (:func:`vitkit.data.stream.stream_batches`: the byte cap, pixel cap, scan bound and
  format allow-list of :mod:`vitkit.images`) to uint8 pixels (``EvalTransform(uint8=True)``, as a GPU job's
  workers do: a quarter of the bytes through the object store), a bad image staying a failed item of its batch
  as locally;
- :class:`EngineActor` (a pool of Ray *actors*, ``actors`` of them) holds the engine, built once per actor from
  the job's :class:`~vitkit.inference.jobs.EngineSpec`, normalises each decoded batch on its device
  (:meth:`~vitkit.inference.engine.InferenceEngine.prepare`: bit for bit the floats the local job's workers
  compute) and runs the job's task over it;
- the driver takes the batches back in input order and hands their columns to the job's sink, which writes the
  same files as the local job (resume, provenance and all: :func:`~vitkit.inference.jobs.run_job`).

A row of the Ray dataset is one batch (its bytes pickled): a batch's images go through the model together, as
they do locally, so every row's numbers are the local job's. Ray is imported only when a job runs on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vitkit.data.stream import ImageSource, StreamBatch, stream_batches
from vitkit.errors import ConfigError, DataError
from vitkit.hardware import cpu_count
from vitkit.inference.jobs import (
    EngineSpec,
    Job,
    JobSummary,
    Steps,
    Task,
    calibration_sample,
    check_batch_fits,
)

Step = tuple[list[str], list[str | None], dict[str, Any]]  # a batch's ids, errors and columns


@dataclass(frozen=True)
class RayOptions:
    """Where and how a job runs on Ray: ``address`` (None: a local cluster started for the job; ``auto``: the
    running cluster; or ``host:port`` / ``ray://host:port``), ``actors`` model actors, each with
    ``cpus_per_actor`` / ``gpus_per_actor`` of Ray's resources and ``threads`` PyTorch threads (0: every core of
    its node, as the local job's model takes), ``retries`` of a decoding batch whose reading raises, ``actor_restarts``
    of a model actor whose process dies (Ray's ``max_restarts``; -1: without limit) with its batches run again
    (``max_task_retries``, the same number), and ``num_cpus``, the CPUs of a local cluster (None: Ray's
    default, every core)."""

    address: str | None = None
    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    threads: int = 0
    retries: int = 3
    actor_restarts: int = -1
    num_cpus: int | None = None

    def check(self) -> None:
        """ConfigError naming the option that is out of range."""
        if self.actors < 1:
            raise ConfigError(f"--actors {self.actors}: at least 1")
        if self.cpus_per_actor < 0 or self.gpus_per_actor < 0:
            raise ConfigError("--cpus-per-actor / --gpus-per-actor: not negative")


def ray_module() -> Any:
    """``ray`` (and ``ray.data``), or ConfigError saying how to install it."""
    try:
        import ray.data  # binds ray too
    except ImportError:
        raise ConfigError("--ray needs Ray Data: pip install 'vitkit[ray]'") from None
    return ray


def _pack(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


class Decode:
    """A Ray Data task (``map_batches(Decode(source, transform), batch_size=1)``): each row's ``positions``
    (int64 bytes) read from ``source`` and transformed as the local job's decoding workers do (``transform``:
    :func:`dataset` gives the job's with ``uint8=True``), to a row holding the batch (positions, ids, labels,
    errors, images of the items that decoded) pickled. A bad image is a
    failed item with the local job's reason (always: whether that stops the job is the driver's ``skip_bad``).
    Reading a batch that raises (a file system error) is tried again, ``retries`` times; a task whose worker dies
    is run again by Ray itself (Ray Data's tasks retry system failures without limit)."""

    def __init__(self, source: ImageSource, transform: Callable[..., Any], retries: int = 3) -> None:
        self.source, self.transform = source, transform  # a vitkit.data.stream.Transform
        self.retries = retries

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = []
        for raw in rows["positions"]:
            positions = np.frombuffer(raw, dtype=np.int64).tolist()
            b = self._read(positions)
            out.append(_pack((b.positions, b.ids, b.labels, b.errors, b.images.numpy())))
        return {"step": np.asarray(rows["step"]), "batch": np.array(out, dtype=object)}

    def _read(self, positions: list[int]) -> Any:
        def read() -> Any:
            (b,) = stream_batches(self.source, self.transform, len(positions), positions=positions, skip_bad=True)
            return b

        for _ in range(self.retries):
            try:
                return read()
            except Exception:  # a bad image is a failed item, never raised: this is the reading itself failing
                continue
        return read()  # the last try: its error is the task's


class EngineActor:
    """A Ray Data actor (``map_batches(EngineActor, fn_constructor_kwargs=...)``): the engine of ``spec`` built
    once for batches of ``batch_size`` (``calibration``: OpenVINO int8's sample), ``threads`` PyTorch threads (0:
    every core of its node); each :class:`Decode` d batch (uint8 pixels normalised here, floats as they are)
    through ``task`` (the local job's: ``(engine, batch) -> columns``), to a row holding (ids, errors, columns)
    pickled and the engine's description."""

    def __init__(
        self,
        spec: EngineSpec,
        task: Task,
        batch_size: int,
        threads: int = 0,
        calibration: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        torch.set_num_threads(threads or cpu_count())  # Ray sets OMP_NUM_THREADS to the actor's num_cpus
        self.engine = spec.build(batch_size, calibration)
        self.task = task

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = []
        for raw in rows["batch"]:
            positions, ids, labels, errors, images = pickle.loads(raw)
            batch = StreamBatch(positions, ids, labels, errors, torch.from_numpy(images))
            (fed,) = self.engine.feed([batch])  # on a GPU: copied there and normalised (uint8 pixels)
            fed = dataclasses.replace(fed, images=self.engine.prepare(fed.images))  # elsewhere normalised here
            out.append(_pack((ids, errors, dict(self.task(self.engine, fed)))))
        described = self.engine.describe()
        return {"step": np.asarray(rows["step"]), "rows": np.array(out, dtype=object),
                "engine": np.array([described] * len(out), dtype=object)}  # fmt: skip


@contextlib.contextmanager
def cluster(options: RayOptions) -> Iterator[Any]:
    """Ray connected for a job: the cluster already connected in this process as it is, else ``options.address``
    (a local cluster when None), disconnected (a local one stopped) at the end."""
    ray = ray_module()
    if ray.is_initialized():
        yield ray
        return
    local = options.address is None
    ray.init(address=options.address, num_cpus=options.num_cpus if local else None, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)  # fmt: skip
    try:
        yield ray
    finally:
        ray.shutdown()


def dataset(ray: Any, job: Job, task: Task, todo: list[int], options: RayOptions) -> Any:
    """The job as a Ray dataset: one row per batch of ``todo``, decoded by :class:`Decode` tasks and run by a
    pool of :class:`EngineActor` s, in input order."""
    source, spec = job.source, dataclasses.replace(job.engine, built=None)  # each actor builds its own
    assert isinstance(source, ImageSource)
    transform = spec.transform()  # the local job's; its decoding tasks stop before normalising (uint8 pixels)
    pixels = dataclasses.replace(transform, uint8=True)
    cpus = ray.cluster_resources().get("CPU", 0)
    if options.actors * options.cpus_per_actor >= cpus:
        raise ConfigError(
            f"--actors {options.actors}: {options.actors} x {options.cpus_per_actor:g} CPU of the cluster's {cpus:g} "
            "would leave none to decode on (fewer actors, or a larger cluster)"
        )
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # the job's own bar
    ctx.print_on_execution_start = False
    b = job.batch_size
    chunks = [np.asarray(todo[s : s + b], dtype=np.int64).tobytes() for s in range(0, len(todo), b)]
    steps = ray.data.from_items([{"step": k, "positions": c} for k, c in enumerate(chunks)],
                                override_num_blocks=max(1, len(chunks)))  # fmt: skip
    decoded = steps.map_batches(Decode(source, pixels, options.retries), batch_size=1, num_cpus=1)
    calibration = lambda: calibration_sample(source, transform)  # noqa: E731
    kwargs = {"spec": spec, "task": task, "batch_size": b, "threads": options.threads, "calibration": calibration}
    # a lost actor (its process killed, its node gone) is started again and its batches rerun: Ray Data's default
    # (max_restarts and max_task_retries -1); another count goes through ray.remote's options, which Ray 2.60
    # deprecates passing to map_batches (and warns)
    n = options.actor_restarts
    restarts = {} if n == -1 else {"max_restarts": n, "max_task_retries": n}
    return decoded.map_batches(
        EngineActor, batch_size=1, fn_constructor_kwargs=kwargs,
        compute=ray.data.ActorPoolStrategy(size=options.actors),
        num_cpus=options.cpus_per_actor, num_gpus=options.gpus_per_actor or None, **restarts,
    )  # fmt: skip


def ray_steps(job: Job, task: Task, summary: JobSummary, *, options: RayOptions) -> Iterator[Step]:
    """:func:`~vitkit.inference.jobs.job_steps` on Ray: the job's batches still to do (``summary.resumed`` on)
    through :func:`dataset`, as (ids, errors, columns) in input order. Without ``job.skip_bad`` the first bad
    image stops the job with its DataError, after the batches before it, as locally."""
    if not isinstance(job.source, ImageSource):
        raise ConfigError("--ray: the input must be files or a dataset (random access), not a stream")
    if job.info.enabled:
        raise ConfigError("--ray: run the job once, not under torchrun (Ray places its own processes)")
    if job.decode == "gpu":
        raise ConfigError("--ray: --decode gpu is not supported (decoding runs as Ray tasks on CPUs)")
    options.check()
    check_batch_fits(job.batch_size, job.engine.model, job.engine.preprocess)
    todo = list(job.order()[summary.resumed :])
    if not todo:
        return
    bar = tqdm(total=summary.total, initial=summary.resumed, desc=job.desc, unit="img", file=sys.stderr,
               disable=not job.progress, smoothing=0.1, dynamic_ncols=True)  # fmt: skip
    with cluster(options) as ray, bar:
        rows = dataset(ray, job, task, todo, options).iter_batches(batch_size=1, batch_format="numpy")
        for want, got in enumerate(rows):
            if int(got["step"][0]) != want:  # preserve_order: never; a wrong row is never written
                raise RuntimeError(f"Ray gave batch {int(got['step'][0])} where batch {want} was due")
            if summary.engine is None:
                summary.engine = str(got["engine"][0])
                if job.on_engine is not None:
                    tqdm.write(f"note: engine: {summary.engine} (in each of {options.actors} Ray actor(s))",
                               file=sys.stderr)  # fmt: skip
            ids, errors, columns = pickle.loads(got["rows"][0])
            bad = next((e for e in errors if e is not None), None)
            if bad is not None and not job.skip_bad:
                raise DataError(bad)
            bar.update(len(ids))
            yield ids, errors, columns


def steps(options: RayOptions) -> Steps:
    """What runs a batch job's steps on Ray with ``options``: pass it as ``steps=`` to
    :func:`vitkit.inference.embed.embed_job` or :func:`vitkit.inference.predict.predict_job` (their local loop is
    :func:`~vitkit.inference.jobs.job_steps`)."""
    return lambda job, task, summary: ray_steps(job, task, summary, options=options)
