"""Every use of FSDP2's private API in mpfp16, in one place, so that a torch release
that moves it breaks this file alone.

What mpfp16 needs beyond ``fully_shard``'s public surface:

- the unsharded 16-bit parameters and accumulated gradients FSDP2 holds between
  steps (``FSDPModule._get_fsdp_state()._fsdp_param_groups[i].fsdp_params``, each
  with ``_unsharded_param`` and ``unsharded_accumulated_grad``), for the optimizer's
  memory accounting;
- FSDP2's default all-gather and reduce-scatter (``DefaultAllGather``,
  ``DefaultReduceScatter``) and their interfaces (``AllGather``, ``ReduceScatter``),
  wrapped so that each call's payload and time are counted.

:func:`is_sharded` (a DTensor check) lives here too, as the one test of "sharded" the
library uses, with the two conversions every layer needs between whole tensors and
shards (:func:`whole`, :func:`held_like`).
"""

from __future__ import annotations

import time

import torch

__all__ = ["is_sharded", "sharded_params", "unsharded_tensors", "accounted_collectives", "whole", "held_like"]


def is_sharded(tensor) -> bool:
    """True for a DTensor: a parameter that FSDP2 (or another DTensor API) sharded."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered (a collective over its mesh), a tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def held_like(t: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``t`` (whole, or a DTensor of any sharding) as ``target`` holds its values: of
    its dtype and device, and, for a DTensor target, of its sharding (a whole tensor is
    cut by each rank alone, with no communication; one of the target's sharding is
    taken as it is)."""
    if is_sharded(t) and is_sharded(target) and (t.device_mesh, tuple(t.placements)) == (
            target.device_mesh, tuple(target.placements)):
        return t.to(target.dtype)
    value = whole(t).to(dtype=target.dtype, device=target.device)
    if not is_sharded(target):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)


def sharded_params(params) -> list[torch.Tensor]:
    """The sharded ones of ``params``, in order."""
    return [p for p in params if is_sharded(p)]


def _fsdp_params(model: torch.nn.Module):
    """FSDP2's per-parameter records (``FSDPParam``) of every unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def unsharded_tensors(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The unsharded parameters and accumulated unsharded gradients (in the compute
    dtype) that FSDP2 holds now for the units of ``model``: (weights, grads). Both are
    empty after a resharding forward and a synchronized backward."""
    weights, grads = [], []
    for fsdp_param in _fsdp_params(model):
        weight = getattr(fsdp_param, "_unsharded_param", None)
        if weight is not None:
            weights.append(weight)
        grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        if grad is not None:
            grads.append(grad)
    return weights, grads


class _Accounted:
    """Wraps one of FSDP2's default collectives and records its payload and time."""

    def __init__(self, inner, stats, busy: list) -> None:
        self.inner, self.stats, self.busy = inner, stats, busy

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _record(self, numel: int, dtype: torch.dtype, started: float, work):
        self.stats.launched(numel, dtype, at=started)

        def done(_fut=None):
            self.busy[0] += time.perf_counter() - started
            self.stats.finished()

        if work is None:
            done()
            return None
        work.get_future().then(done)
        return work


def accounted_collectives(gather_stats, gather_busy: list, scatter_stats, scatter_busy: list):
    """FSDP2's default all-gather and reduce-scatter, each counting its calls.

    Args:
        gather_stats, scatter_stats: where each call is counted, a
            :class:`mpfp16.parallel.hooks.CommStats` (``launched`` when it is issued,
            ``finished`` when its result is ready).
        gather_busy, scatter_busy: one-element lists; each call adds its seconds from
            launch to result to element 0.

    Returns:
        (all-gather, reduce-scatter), for ``FSDPModule.set_custom_all_gather`` and
        ``set_custom_reduce_scatter``. The all-gather's payload is the whole gathered
        buffer, as nccl-tests counts an all-gather; the reduce-scatter's is its input.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class AccountedAllGather(_Accounted, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            started = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, async_op=async_op)
            return self._record(output_tensor.numel(), output_tensor.dtype, started, work)

    class AccountedReduceScatter(_Accounted, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            started = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, op, async_op=async_op)
            return self._record(input_tensor.numel(), input_tensor.dtype, started, work)

    return (AccountedAllGather(DefaultAllGather(), gather_stats, gather_busy),
            AccountedReduceScatter(DefaultReduceScatter(), scatter_stats, scatter_busy))
