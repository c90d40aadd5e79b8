"""Sharded master weights on torch's FSDP2 (``fully_shard``).

    model = mpfp16.distributed.shard(model)                 # the fp32 model, after init()
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters()), model=model)

:func:`shard` gives each block, each normalization layer and the root its own
``fully_shard`` unit. Each rank then holds 1/N of every parameter, in fp32: the
sharded parameters *are* the master weights, and their sharded gradients are fp32.
Before a unit's forward (and backward) FSDP2 casts its shards to ``param_dtype`` and
all-gathers them, so the model computes in fp16 as a :func:`mpfp16.to_half` model
does; after backward it reduce-scatters the 16-bit gradients in ``reduce_dtype`` and
casts each rank's shard to fp32. Normalization layers keep fp32 parameters (and
reduce in fp32), as ``to_half`` keeps them: one policy, :func:`mpfp16.convert.keeps_fp32`.
:class:`mpfp16.FP16Optimizer` unscales, checks, clips and steps the fp32 shards; there
is nothing to copy back, since the next forward all-gathers the new fp16 values.

The differences from DDP, all of FSDP2's making: the all-gathers (one per unit per
forward, and per backward with ``reshard_after_forward``), and the gradient
reduction: FSDP2 divides fp16 gradients by about sqrt(N) before the sum and by the
rest after it, where mpfp16's DDP hook sums first (equal for N = 2 except in
subnormals; for N > 2 it differs in rounding only).

What mpfp16 knows of a sharded model is in its handle (:mod:`mpfp16.parallel.handles`);
the FSDP2 internals it reads are in :mod:`mpfp16.parallel.fsdp_shim`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..convert import HALF_DTYPES, keeps_fp32
from ..errors import library_words
from . import ranks
from .fsdp_shim import accounted_collectives
from .handles import Handle, handle_of, register
from .hooks import CommStats

__all__ = ["shard", "check_options", "is_sharded_model", "find_blocks", "set_gradient_sync", "ShardCommStats",
           "REDUCE_DTYPES"]

REDUCE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)  # reduce_dtype's choices; None: param_dtype


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: every child of an ``nn.Sequential`` or
    ``nn.ModuleList`` that has submodules of its own and parameters (a ResNet's
    residual blocks, a transformer's layers), in post-order (innermost first)."""
    blocks = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            for child in module.children():
                has_children = next(child.children(), None) is not None
                if has_children and not keeps_fp32(child) and any(True for _ in child.parameters()):
                    blocks.append(child)

    visit(model)
    return blocks


class ShardCommStats:
    """Per-step communication of a sharded model: all-gathers (of parameters) and
    reduce-scatters (of gradients), each a :class:`mpfp16.parallel.hooks.CommStats`."""

    def __init__(self) -> None:
        self.all_gather = CommStats()
        self.reduce_scatter = CommStats()
        self._busy = {"all_gather": [0.0], "reduce_scatter": [0.0]}  # seconds, summed over calls

    def new_round(self) -> None:
        self.all_gather.new_round()
        self.reduce_scatter.new_round()

    def pop_step(self) -> dict:
        """``{all_gather,reduce_scatter}_{calls,bytes,time_s,wait_s}`` since the last
        call (see :meth:`mpfp16.parallel.hooks.CommStats.pop_step`; a round is a
        forward and its backward, so the all-gathers' ``time_s`` spans both), ``*_busy_s``: each
        collective's time from launch to result, summed over the calls, and
        ``allreduce_calls``/``allreduce_bytes`` (0: a sharded model allreduces nothing)."""
        out = {"allreduce_calls": 0, "allreduce_bytes": 0}
        for kind, stats in (("all_gather", self.all_gather), ("reduce_scatter", self.reduce_scatter)):
            for key, value in stats.pop_step().items():
                out[key.replace("allreduce", kind)] = value
            out[f"{kind}_busy_s"], self._busy[kind][0] = self._busy[kind][0], 0.0
        return out

    def collectives(self):
        """FSDP2's all-gather and reduce-scatter, counting into these figures
        (:func:`mpfp16.parallel.fsdp_shim.accounted_collectives`)."""
        return accounted_collectives(self.all_gather, self._busy["all_gather"], self.reduce_scatter,
                                     self._busy["reduce_scatter"])


@torch.no_grad()
def _as_to_half(model: nn.Module, dtype: torch.dtype) -> None:
    """What :func:`mpfp16.to_half` would make of ``model``, kept in fp32: parameters of
    the layers it converts (all but those :func:`mpfp16.convert.keeps_fp32`)
    rounded to ``dtype`` (the masters then start from the 16-bit weights, as they do on
    the DDP path), and their floating-point buffers cast to ``dtype`` (normalization
    statistics stay fp32)."""
    for module in model.modules():
        if keeps_fp32(module):
            continue
        for p in module.parameters(recurse=False):
            p.copy_(p.to(dtype))
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


class _BufferSync:
    """Rank 0's buffers (BatchNorm statistics) before a training forward, when the
    previous training forward synchronized gradients: what DDP does with
    ``broadcast_buffers=True`` (under ``no_sync`` accumulation, at the first
    micro-batch of each step only)."""

    def __init__(self, group) -> None:
        self.group, self.next_forward = group, True

    def before_forward(self, module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.next_forward and ranks.get_world_size(self.group) > 1:
            ranks.broadcast_buffers(module, src=dist.get_global_rank(self.group, 0), process_group=self.group)
        handle = handle_of(module)
        self.next_forward = handle.sync if handle is not None else True


def check_options(param_dtype: torch.dtype, reduce_dtype: torch.dtype | None, say=library_words) -> None:
    """Refuse, in one line, dtypes :func:`shard` cannot honour.

    Args:
        param_dtype, reduce_dtype: as :func:`shard` takes them.
        say: ``say(name, value)`` words an option as the caller spells it (default
            ``name=value``).

    Raises:
        ValueError: naming the option refused.
    """
    if param_dtype not in HALF_DTYPES:
        raise ValueError(f"{say('param_dtype', param_dtype)} is not possible for a sharded model: it computes in "
                         "float16 or bfloat16 over its sharded fp32 masters")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"{say('reduce_dtype', reduce_dtype)} must be None, float16, bfloat16 or float32")


def shard(model: nn.Module, param_dtype: torch.dtype = torch.float16, reduce_dtype: torch.dtype | None = None,
          reshard_after_forward: bool = True, *, blocks: list[nn.Module] | None = None, mesh=None,
          broadcast_buffers: bool = True) -> nn.Module:
    """Shard ``model`` across the ranks with FSDP2, fp32 masters and ``param_dtype`` compute.

    Args:
        model: the fp32 model, on its device (its fp32 parameters become the sharded
            masters: do not call :func:`mpfp16.to_half` first).
        param_dtype: the compute and all-gather dtype: ``torch.float16`` or
            ``torch.bfloat16``.
        reduce_dtype: the gradients' dtype in the reduce-scatter; default
            ``param_dtype``; ``torch.float32`` reduces in fp32.
        reshard_after_forward: free each unit's gathered parameters after its forward
            and gather them again for backward (less memory, one more all-gather per
            unit); False keeps them until after backward.
        blocks: the submodules that get their own unit; default :func:`find_blocks`.
        mesh: a 1-D ``DeviceMesh``; default all ranks of the default group.
        broadcast_buffers: give every rank rank 0's buffers before training forwards,
            as DDP does (module docstring of :class:`_BufferSync`).

    Returns:
        ``model``, now an ``FSDPModule``, registered with a ``"sharded"`` handle
        (:func:`mpfp16.parallel.handles.handle_of`). Its per-step communication
        figures are ``mpfp16.distributed.comm_stats(model).pop_step()``; accumulate
        without communication under ``mpfp16.distributed.sync_gradients(model, False)``.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not ranks.is_initialized():
        raise RuntimeError("shard() needs torch.distributed: call mpfp16.distributed.init() first (under torchrun, "
                           "or for one process)")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("shard() got a DistributedDataParallel module: shard the plain model instead of wrapping it")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already sharded: call shard() once")
    check_options(param_dtype, reduce_dtype)
    not_contiguous = [name for name, p in model.named_parameters() if not p.is_contiguous()]
    if not_contiguous:  # FSDP2 itself would raise NotImplementedError at its first forward
        raise ValueError(f"parameter {not_contiguous[0]} is not contiguous (channels_last, say), and FSDP2 shards "
                         "contiguous parameters only: shard the model in its default memory format")
    not_fp32 = [(name, p.dtype) for name, p in model.named_parameters() if p.dtype != torch.float32]
    if not_fp32:
        name, dtype = not_fp32[0]
        raise ValueError(f"shard() takes the fp32 model, whose sharded fp32 parameters become the master weights; "
                         f"parameter {name} is {dtype}: do not call to_half() (or .half()) before shard()")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    group = mesh.get_group()
    stats = ShardCommStats()
    gather, scatter = stats.collectives()
    # gloo has no AVG reduction: there FSDP2 must sum and divide (it does so for fp16 anyway).
    force_sum = dist.get_backend(group) == "gloo"

    def unit(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)

    _as_to_half(model, param_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in model.modules():
        if keeps_fp32(module) and any(True for _ in module.parameters(recurse=False)):
            unit(module, fp32)
    half = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in (find_blocks(model) if blocks is None else blocks):
        if block is not model:
            unit(block, half)
    unit(model, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32))
    register(model, Handle("sharded", stats=stats, group=group, param_dtype=param_dtype))
    model.register_forward_pre_hook(lambda module, args: stats.new_round())
    if broadcast_buffers:
        model.register_forward_pre_hook(_BufferSync(group).before_forward)
    return model


def set_gradient_sync(model: nn.Module, sync: bool):
    """A context in which a sharded model's backward reduce-scatters (``sync``) or
    accumulates its unsharded gradients locally (FSDP2's ``set_requires_gradient_sync``).
    The handle records the setting, so that the buffer sync knows whether the next
    forward starts a step."""
    handle = handle_of(model)

    @contextlib.contextmanager
    def ctx():
        before = handle.sync if handle is not None else True
        model.set_requires_gradient_sync(sync)
        if handle is not None:
            handle.sync = sync
        try:
            yield
        finally:
            model.set_requires_gradient_sync(before)
            if handle is not None:
                handle.sync = before

    return ctx()


def is_sharded_model(model: nn.Module) -> bool:
    """True for the model :func:`shard` returned."""
    handle = handle_of(model)
    return handle is not None and handle.kind == "sharded"
