"""torchrun's process groups, shared by training (:mod:`vitkit.train.parallel` adds model wrapping and
failure handling) and the batch jobs (``predict``, ``embed``, ``eval``, ``knn`` shard their input across processes).

Launch with ``torchrun --nproc_per_node N -m vitkit ...``: torchrun's standard variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) say which process this is; that is the only reason this module reads the
environment. The backend is NCCL on GPUs and gloo on CPUs.

A batch job's sharding (:func:`shard_steps`): the positions still to do are cut into batches of ``batch_size``,
dealt out in turn (batch ``c`` to process ``c % world``), and every process runs the same number of steps; step
``s`` of all processes together covers consecutive batches of the input, so process 0 gathers each step's
results (:func:`gather_to_main`) and writes them in input order as it goes: one output, the file one process
writes (the same batches, so the same numbers), resumable the same way. Every process lists the input itself,
so they first compare what they listed (:func:`check_same_input`): a process that sees other files is one line
on every process, not a job that hangs until the group's timeout or writes rows of two inputs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vitkit.errors import DataError
from vitkit.hardware import resolve_device


@dataclass(frozen=True)
class DistInfo:
    """This process's place in a job: ``rank`` of ``world`` processes (``local_rank`` of ``local_world`` on this
    machine), its ``device``, and the process group's ``backend`` (None: a single process, no group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (a single process not started by torchrun)
    local_world: int = 1  # processes on this machine (they share its cores)

    @property
    def enabled(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Process 0 (the one that writes and prints)."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether torchrun (or a launcher setting its variables) started this process: WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT all set."""
    return all(k in os.environ for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def setup(device: str = "auto") -> DistInfo:
    """Join the process group torchrun set up (if any) and pick this process's device.

    Under torchrun the group is formed and the model wrapped (``wrap``) even for one process
    (``--nproc_per_node 1``): DDP or FSDP2 over NCCL then runs on a single GPU, as the strategy was asked for."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world < 1 or (world == 1 and not launched_by_torchrun()):
        return DistInfo(device=dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return DistInfo(rank, world, local_rank, dev, backend, local_world)


def teardown(info: DistInfo, clean: bool = True) -> None:
    """Leave the process group: together after a clean finish (no process exits while another still talks
    to it); at once after an error, so that the peers' pending collectives fail instead of hanging."""
    if info.backend is not None and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """``t`` summed over the processes, in place (one process: ``t``)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_int(value: int, info: DistInfo) -> int:
    """Process 0's ``value``, on every process."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def barrier(info: DistInfo) -> None:
    """Wait until every process gets here (one process: return)."""
    if info.enabled:
        dist.barrier()


def shard_steps(positions: Sequence[int], batch_size: int, info: DistInfo) -> tuple[list[int], int]:
    """This process's share of ``positions`` and the number of steps of ``batch_size`` every process runs (the
    last steps of some processes may be empty): batch ``c`` (``positions[c*batch_size ..]``) goes to process
    ``c % world``, so every batch is the one a single process forms (the same images together: the same
    floating-point rounding) and one step of all processes covers consecutive batches, in rank order. The one
    sharding scheme: the batch jobs' and a training run's validation (``vitkit.data.loader.eval_batches``)."""
    mine = [p for j, p in enumerate(positions) if (j // batch_size) % info.world == info.rank]
    batches = -(-len(positions) // batch_size)
    return mine, -(-batches // info.world)


def gather_to_main(value: Any, info: DistInfo) -> list[Any] | None:
    """Every process's ``value`` (any picklable object), in rank order, on process 0; None on the others.
    One process: ``[value]``."""
    if not info.enabled:
        return [value]
    out: list[Any] | None = [None] * info.world if info.is_main else None
    dist.gather_object(value, out, dst=0)
    return out


def broadcast_from_main(value: Any, info: DistInfo) -> Any:
    """Process 0's ``value`` (any picklable object), on every process."""
    if not info.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def input_digest(ids: Iterable[str]) -> tuple[int, str]:
    """(how many, SHA-256) of a list of item ids, in order."""
    h, n = hashlib.sha256(), 0
    for item in ids:
        h.update(item.encode("utf-8", "backslashreplace"))
        h.update(b"\0")
        n += 1
    return n, h.hexdigest()


def check_same_input(ids: Iterable[str], info: DistInfo, what: str = "the input") -> None:
    """DataError on every process unless every process lists the same item ids in the same order (``ids``:
    this process's list; one process: nothing to compare). Every process sends the count and SHA-256 of its
    list to every other (one collective, so no process goes on alone into steps the others never take)."""
    if not info.enabled:
        return
    every: list[Any] = [None] * info.world
    dist.all_gather_object(every, input_digest(ids))
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        r = differ[0]
        raise DataError(
            f"{what}: process {r} of {info.world} lists {every[r][0]} images ({every[r][1][:12]}) and process 0 "
            f"lists {every[0][0]} ({every[0][1][:12]}): every process must see the same input (the same files, "
            "paths and working directory on every machine, and no files added or removed while the job starts)"
        )
