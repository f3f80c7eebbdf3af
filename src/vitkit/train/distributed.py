"""Process groups and model wrapping for multi-process data-parallel training.

Launch with ``torchrun --nproc_per_node N -m vitkit train ...``: torchrun's standard variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) say which process this is; that is the only reason this module
reads the environment. The backend is NCCL on GPUs and gloo on CPUs; the code path is otherwise the same.

Strategies: ``ddp`` (DistributedDataParallel; every process holds the whole model, gradients are
averaged), ``fsdp`` (FSDP2 ``fully_shard`` on every transformer block and the root: parameters,
gradients and optimiser state are sharded across processes -- for the large variants).
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vitkit.errors import ConfigError
from vitkit.hardware import resolve_device


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: a single process, no process group

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
    return DistInfo(rank, world, local_rank, dev, backend)


def teardown(info: DistInfo, clean: bool = True) -> None:
    """Leave the process group: together after a clean finish (no process exits while another still talks
    to it); at once after an error, so that the peers' pending collectives fail instead of hanging."""
    if info.enabled and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


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
    from torch.utils.checkpoint import checkpoint

    forward = type(block).forward.__get__(block)
    if not torch.is_grad_enabled():
        return forward(*args)
    return checkpoint(forward, *args, use_reentrant=False)


def wrap(model: nn.Module, strategy: str, info: DistInfo, *, grad_checkpointing: bool = False) -> nn.Module:
    """The model as trained: itself (1 process), DDP, or FSDP2-sharded in place (blocks, then the root);
    with ``grad_checkpointing``, its blocks recompute their activations in the backward pass first."""
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
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ConfigError(f"unknown distributed strategy {strategy!r} (ddp, fsdp)")


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
