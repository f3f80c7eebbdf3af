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
import signal
import threading
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from vitkit.distributed import DistInfo, all_reduce_sum, barrier, broadcast_int, launched_by_torchrun, setup, teardown
from vitkit.errors import ConfigError, VitkitError

__all__ = [  # the process-group helpers live in vitkit.distributed (the batch jobs use them too)
    "DistInfo", "FailureNotice", "PeerFailure", "StopSignal", "Terminated", "all_reduce_sum", "barrier",
    "broadcast_int", "checkpoint_activations", "fsdp_mixed_precision", "full_tensor", "launched_by_torchrun",
    "load_full_into", "setup", "teardown", "wrap",
]  # fmt: skip


FAILURE_KEY = "vitkit/failure"  # in the process group's store: the first failed process's one-line error


class PeerFailure(VitkitError):
    """Another process of the run failed; the message is that process's error. The process raising it ignores
    SIGTERM from then on (``StopSignal``): it is expected to report this and exit."""


class Terminated(VitkitError):
    """This process was sent SIGTERM during a multi-process run (torchrun's agent stops the remaining processes
    this way once one has exited)."""


class FailureNotice:
    """What a process whose run raised ``error`` tells the others, through the rendezvous store at
    MASTER_ADDR:MASTER_PORT (torchrun's agent serves it, so it outlives any one worker).

    The first failure is recorded; a process that fails later because of it (a collective whose peer left:
    gloo's "connection closed by peer") finds it and gets it as ``peer``, a :class:`PeerFailure` to raise
    instead of its own error. The failed process then leaves at once: its peers' pending collectives fail only
    when its connections close, and with DDP or FSDP holding the process group that is when the process exits
    (measured with torch 2.13's gloo: destroying, aborting or shutting down the group does not close them).
    """

    def __init__(self, info: DistInfo, error: BaseException) -> None:
        self.peer: PeerFailure | None = None
        if not (info.enabled and dist.is_initialized()):
            return
        try:  # a client of its own: the group's may already be closed by the failure
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=5)
            )
        except (KeyError, ValueError, RuntimeError):
            return
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        mine = f"process {info.rank}: {text if isinstance(error, VitkitError) else f'{type(error).__name__}: {text}'}"
        try:
            value = store.compare_set(FAILURE_KEY, "", mine)  # the first failure wins
            first = value.decode() if isinstance(value, bytes) else str(value)
            if first != mine:
                self.peer = PeerFailure(f"stopped because {first}")
        except (RuntimeError, ValueError):  # no store to tell: each process reports its own error
            pass


class StopSignal:
    """SIGTERM during a multi-process run, as a :class:`Terminated` exception, so that the run stops through
    its failure path (``FailureNotice``) instead of dying where it stands.

    When one worker exits, torchrun's agent sends SIGTERM to the others (SIGKILL 30 s later). Their collectives
    fail at the same moment (the exited worker's connections close), so without this the agent's signal
    raced their report of the first failure and sometimes killed them before it (a slow test lost it 1 run in
    ~10). Installed for the run's lifetime in the main thread of a multi-process run; ``stop`` holds further
    SIGTERMs off while the failure is handled and ``release`` puts back the previous handler. A process stopped
    by another's failure keeps SIGTERM held (``release(keep_holding=True)``): it is about to raise
    :class:`PeerFailure`, and its caller reports that and exits.
    """

    def __init__(self, info: DistInfo) -> None:
        self.previous: Any = None
        self.armed = info.enabled and threading.current_thread() is threading.main_thread()
        if self.armed:
            self.previous = signal.signal(signal.SIGTERM, self._raise)

    def _raise(self, signum: int, frame: object) -> None:
        self.stop()
        raise Terminated("stopped by SIGTERM")

    def stop(self) -> None:
        """From now on SIGTERM is ignored (until ``release``)."""
        if self.armed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def release(self, keep_holding: bool = False) -> None:
        if self.armed and not keep_holding:
            signal.signal(signal.SIGTERM, self.previous)
        self.armed = False


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


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(block).forward.__get__(block)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def wrap(
    model: nn.Module, strategy: str, info: DistInfo, *, grad_checkpointing: bool = False, precision: str = "fp32"
) -> nn.Module:
    """The model as trained: itself (1 process), DDP, or FSDP2-sharded in place (blocks, then the root);
    with ``grad_checkpointing``, its blocks recompute their activations in the backward pass first.

    FSDP2 on GPUs under ``precision="bf16"`` gathers parameters and computes in bf16 and reduces gradients
    in fp32 (``fsdp_mixed_precision``); the sharded fp32 parameters stay the optimiser's master copy."""
    if grad_checkpointing:
        checkpoint_activations(model)
    if info.backend is None:  # no process group: a plain single-process run
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
