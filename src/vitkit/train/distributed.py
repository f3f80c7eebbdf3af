"""Process groups and model wrapping for multi-process data-parallel training.

Launch with ``torchrun --nproc_per_node N -m vitkit train ...``: torchrun's standard variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) say which process this is; that is the only reason this module
reads the environment. The backend is NCCL on GPUs and gloo on CPUs; the code path is otherwise the same.

Strategies: ``ddp`` (DistributedDataParallel; every process holds the whole model, gradients are
averaged), ``fsdp`` (FSDP2 ``fully_shard`` on every transformer block and the root: parameters,
gradients and optimiser state are sharded across processes -- for the large variants).
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from vitkit.errors import ConfigError, VitkitError
from vitkit.hardware import resolve_device


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: a single process, no process group
    local_world: int = 1  # processes on this machine (they share its cores)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str = "auto") -> DistInfo:
    """Join the process group torchrun set up (if any) and pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world <= 1:
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
    if info.enabled and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


FAILURE_KEY = "vitkit/failure"  # in the process group's store: the first failed process's one-line error
SEEN_KEY = "vitkit/failure_seen"  # how many other processes have read it


class PeerFailure(VitkitError):
    """Another process of the run failed; the message is that process's error."""


class FailureNotice:
    """What a process whose run raised ``error`` tells the others, through the rendezvous store at
    MASTER_ADDR:MASTER_PORT (torchrun's, or process 0's), before it leaves the group.

    The first failure is recorded; a process that fails later because of it (a collective whose peer left:
    gloo's "connection closed by peer") finds it and gets it as ``peer``, a :class:`PeerFailure` to raise
    instead of its own error. Leaving the group (``teardown(clean=False)``) makes the peers' pending
    collectives fail at once, so nobody waits out the process-group timeout; the failed process then waits
    (``wait_for_peers``, a few seconds at most) until the others have read its error and left the group
    (``acknowledge``), because the store may be served by its own process. Under torchrun the agent also
    stops the remaining processes when one exits.
    """

    def __init__(self, info: DistInfo, error: BaseException) -> None:
        self.info, self.peer, self.store = info, None, None
        if not (info.enabled and dist.is_initialized()):
            return
        try:  # a client of its own: the group's may already be closed by the failure; held until wait_for_peers
            self.store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=5)
            )
        except (KeyError, ValueError, RuntimeError):
            return
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        mine = f"process {info.rank}: {text if isinstance(error, VitkitError) else f'{type(error).__name__}: {text}'}"
        try:
            value = self.store.compare_set(FAILURE_KEY, "", mine)  # the first failure wins
            first = value.decode() if isinstance(value, bytes) else str(value)
            if first != mine:
                self.peer = PeerFailure(f"stopped because {first}")
        except (RuntimeError, ValueError):  # the store is gone with the process that served it
            self.store = None

    def acknowledge(self) -> None:
        """A process stopped by another's failure: say it has read that error, once it has left the group. The
        failed process waits for this before it exits, and under torchrun its exit makes the agent stop the
        others: acknowledged earlier (while still leaving the group), a peer could be stopped before it had
        reported the error."""
        if self.store is None or self.peer is None:
            return
        with contextlib.suppress(RuntimeError, ValueError):
            self.store.add(SEEN_KEY, 1)
        self.store = None

    def wait_for_peers(self, timeout: float = 10.0) -> None:
        """After leaving the group: wait until every other process has read this failure (or ``timeout``)."""
        if self.store is None or self.peer is not None:
            return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(RuntimeError, ValueError):
            while self.store.add(SEEN_KEY, 0) < self.info.world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        self.store = None


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Activation checkpointing, in place: every transformer block keeps only its input in the forward pass
    and recomputes its activations in the backward pass (less memory for one more forward of the blocks).

    Only the blocks' ``forward`` changes (non-reentrant ``torch.utils.checkpoint``); parameter names, the
    state dict, DDP/FSDP wrapping and ``torch.compile`` see the same model. Without gradients (evaluation)
    blocks run as usual.
    """
    for block in model.blocks:  # type: ignore[union-attr]
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def _checkpointed_forward(block: nn.Module, *args: Any) -> Any:
    forward = type(block).forward.__get__(block)
    if not torch.is_grad_enabled():
        return forward(*args)
    return checkpoint(forward, *args, use_reentrant=False)


def wrap(
    model: nn.Module, strategy: str, info: DistInfo, *, grad_checkpointing: bool = False, precision: str = "fp32"
) -> nn.Module:
    """The model as trained: itself (1 process), DDP, or FSDP2-sharded in place (blocks, then the root);
    with ``grad_checkpointing``, its blocks recompute their activations in the backward pass first.

    FSDP2 on GPUs under ``precision="bf16"`` gathers parameters and computes in bf16 and reduces gradients
    in fp32 (``fsdp_mixed_precision``); the sharded fp32 parameters stay the optimiser's master copy."""
    if grad_checkpointing:
        checkpoint_activations(model)
    if not info.enabled:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids, broadcast_buffers=False)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world,))
        mp = fsdp_mixed_precision(precision, info.device)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    raise ConfigError(f"unknown distributed strategy {strategy!r} (ddp, fsdp)")


def fsdp_mixed_precision(precision: str, device: torch.device) -> Any:
    """FSDP2's MixedPrecisionPolicy: bf16 parameters (all-gathers, compute) with fp32 gradient reduction for
    bf16 on a GPU; full fp32 otherwise (on CPUs bf16 runs as autocast only)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16" and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
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
    if info.enabled:
        dist.barrier()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) DTensor; a collective when it is sharded."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full_into(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into ``dst``, which may be a shard (DTensor) of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(dst, DTensor):
            dst.copy_(distribute_tensor(full.to(dst.device), dst.device_mesh, dst.placements))
        else:
            dst.copy_(full)
