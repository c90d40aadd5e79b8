"""torch.distributed for data-parallel training: set-up from torchrun, DDP wrapping,
FSDP2 sharding, accumulation without communication, and teardown.

    info = mpfp16.distributed.init()              # reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK
    model = mpfp16.distributed.wrap(model, allreduce_dtype=None, predivide_factor=1.0)
    for micro in range(accum_steps):
        with mpfp16.distributed.sync_gradients(model, micro == accum_steps - 1):
            opt.backward(loss_fn(model(x), y) / accum_steps)
    opt.step(); stats = mpfp16.distributed.comm_stats(model).pop_step()
    mpfp16.distributed.teardown()

The public face of :mod:`mpfp16.parallel`, where the code lives: rank helpers
(``parallel.ranks``), set-up and teardown (``parallel.setup``), DDP and its hooks
(``parallel.ddp``, ``parallel.hooks``, ``parallel.powersgd``), FSDP2 (``parallel.fsdp``)
and the replica check (``parallel.replicas``). What each wrapped model needs is in its
handle (``parallel.handles``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from .errors import ReplicaDivergenceError
from .parallel.ranks import (all_gather_object, broadcast_buffers, broadcast_object, gather_object, get_rank,
                            get_world_size, is_initialized, is_main_process)
from .parallel.ddp import attach, comm_state_dict, load_comm_state_dict, wrap
from .parallel.fsdp import set_gradient_sync, shard
from .parallel.handles import handle_of
from .parallel.hooks import CommStats
from .parallel.replicas import check_replicas
from .parallel.setup import BACKENDS, DEFAULT_TIMEOUT_S, DistInfo, init, teardown  # BACKENDS: the choices of init()

__all__ = [
    "DistInfo", "init", "teardown", "wrap", "attach", "shard", "sync_gradients", "comm_stats", "comm_state_dict",
    "load_comm_state_dict", "check_replicas", "ReplicaDivergenceError", "broadcast_buffers", "broadcast_object",
    "all_gather_object", "gather_object", "get_rank", "get_world_size", "is_main_process", "DEFAULT_TIMEOUT_S",
    "is_initialized", "BACKENDS",
]


def comm_stats(model: torch.nn.Module) -> CommStats | None:
    """The :class:`mpfp16.parallel.hooks.CommStats` of a model made by :func:`wrap` (a
    :class:`mpfp16.parallel.fsdp.ShardCommStats` for one made by :func:`shard`); None
    for any other."""
    handle = handle_of(model)
    return handle.stats if handle is not None else None


def sync_gradients(model: torch.nn.Module, sync: bool):
    """A context for one micro-batch's backward.

    ``sync=False`` runs it under DDP's ``no_sync()`` (for a model made by
    :func:`shard`, with FSDP2's gradient sync off): the gradients accumulate locally
    and nothing is sent. Pass ``sync=True`` only on the last micro-batch before
    ``step()``, so that the allreduce (or reduce-scatter) runs once per optimizer
    step, whatever the number of accumulation steps. For any other model it does
    nothing.
    """
    handle = handle_of(model)
    if handle is not None and handle.kind == "sharded":
        return set_gradient_sync(model, sync)
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()  # any DDP module, wrap()'s or the user's own
