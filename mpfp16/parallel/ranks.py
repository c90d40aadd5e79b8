"""Rank helpers: where this process stands, and how every rank reaches one decision.

This module imports nothing from mpfp16, so that every layer above it (the optimizer's
step, the checkpoints, the DDP and FSDP2 wrappers) can use it without a circle.

Every decision that must be the same on every rank goes through one of two helpers:

- :func:`any_rank`: True on every rank when it is True on any (one small max-reduce):
  the step's overflow flag, a stop signal;
- :func:`failures`: ``{rank: error}`` of the ranks that failed, the same on every rank
  (one small all-gather of a flag, and the messages only when something failed): a
  compile, a checkpoint write, a run directory that rank 0 refused.

:func:`max_over_ranks` is :func:`any_rank` for a small integer (which signal asked the
run to stop). Outside torch.distributed (one process) these answer for this process
alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_initialized", "get_rank", "get_world_size", "is_main_process", "group_ranks", "any_rank",
           "max_over_ranks", "failures", "raise_first", "broadcast_object", "all_gather_object", "gather_object",
           "broadcast_buffers"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size(group=None) -> int:
    """Processes in ``group`` (default: all); 1 when not distributed."""
    return dist.get_world_size(group) if is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, and in a run that is not distributed."""
    return get_rank() == 0


def group_ranks(group=None) -> list[int]:
    """The global ranks of ``group`` (default: all), in its order."""
    if not is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _flag_device(group) -> torch.device:
    """Where a collective of ``group`` takes its tensors: NCCL's are on this rank's GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag, group=None) -> bool:
    """True on every rank of ``group`` when ``flag`` is true on any of them.

    Args:
        flag: a bool, or a tensor whose first element is nonzero when set (it stays on
            its device, and is max-reduced in place: the caller's one host
            synchronization is the read that follows).
        group: the ranks that must agree (default: all).
    """
    if not torch.is_tensor(flag):
        if not is_initialized() or get_world_size(group) == 1:
            return bool(flag)
        flag = torch.tensor([1.0 if flag else 0.0], device=_flag_device(group))
    elif is_initialized() and get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.reshape(-1)[0].item())


def max_over_ranks(value: int, group=None) -> int:
    """The largest of every rank's ``value`` (an integer), on every rank of ``group``
    (default: all): one small max-reduce; ``value`` itself when not distributed."""
    if not is_initialized() or get_world_size(group) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_flag_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def failures(error: str | None, group=None) -> dict[int, str]:
    """``{global rank: error}`` of the ranks of ``group`` whose ``error`` is not None,
    identical on every rank of ``group``. Costs one all-gather of a 4-byte flag; the
    messages travel only when some rank failed."""
    if not is_initialized() or get_world_size(group) == 1:
        return {get_rank(): error} if error is not None else {}
    flag = torch.tensor([error is not None], dtype=torch.int32, device=_flag_device(group))
    flags = [torch.empty_like(flag) for _ in range(get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    if not any(bool(f.item()) for f in flags):
        return {}
    errors: list = [None] * len(flags)
    dist.all_gather_object(errors, error, group=group)
    return {rank: e for rank, e in zip(group_ranks(group), errors) if e is not None}


def raise_first(found: dict[int, str], exc_type: type[Exception] = RuntimeError) -> None:
    """Raise ``exc_type`` with the lowest failing rank's message (of what
    :func:`failures` returned), on every rank; nothing when no rank failed."""
    if found:
        raise exc_type(found[min(found)])


def broadcast_object(obj, src: int = 0, group=None):
    """``src``'s ``obj`` on every rank (a picklable value); ``obj`` itself when not
    distributed."""
    if not is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order; ``[obj]`` when not distributed."""
    if not is_initialized():
        return [obj]
    gathered = [None] * get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` (picklable), in rank order, on rank ``dst``; None on the
    others; ``[obj]`` when not distributed. Unlike :func:`all_gather_object`, only
    ``dst`` receives, for objects as large as a model (PowerSGD's error feedback)."""
    if not is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


@torch.no_grad()
def broadcast_buffers(model: torch.nn.Module, src: int = 0, process_group=None) -> None:
    """Give every rank ``src``'s buffers (BatchNorm statistics), as DDP does at the
    start of each forward pass; nothing when not distributed."""
    if not is_initialized():
        return
    for buf in model.buffers():
        dist.broadcast(buf, src=src, group=process_group)
