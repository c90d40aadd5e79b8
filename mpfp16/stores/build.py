"""The one way a store is made: chosen from the parameters, placed, and ready to step,
fused or not.

:func:`build_store` decides the kind (sharded for FSDP2's DTensors, else local: flat,
or per-tensor where parameters can no longer move) and whether the step runs mpfp16's
fused kernels (:data:`FUSED_MIN_NUMEL`, the inner optimizer's own ``fused=True`` or
``foreach=True``, what the store and the optimizer support), and says why in one log
line where it is not what was asked for. The kernels' compile, and the agreement of the
ranks about it, are the store's (``ParamStore.prepare``).
"""

from __future__ import annotations

import logging

import torch

from ..parallel.ranks import is_main_process
from .fused import fast_path_flag, unsupported_reason
from .interface import ParamStore
from .local import LocalStore, build_local_store
from .sharded import ShardedStore, holds_sharded

__all__ = ["build_store", "store_type", "FUSED_MIN_NUMEL"]

logger = logging.getLogger("mpfp16")

FUSED_MIN_NUMEL = 1 << 20  # below this, fused=None keeps the unfused step (no compile time)


def store_type(params: list[torch.Tensor]) -> type[ParamStore]:
    """The kind of store ``params`` need, before anything is placed: sharded for
    DTensors, else a local one (flat or per-tensor, decided while placing)."""
    return ShardedStore if holds_sharded(params) else LocalStore


def build_store(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, model, master_weights: bool | str,
                rounding: str, accumulate: bool = False, fused: bool | None = None, state_dtypes: dict | None = None,
                state_rounding: str = "nearest") -> ParamStore:
    """The store for ``params`` (every parameter ``optimizer`` holds, in its order),
    ready to step.

    Args:
        accumulate: sum the micro-batches' 16-bit gradients in fp32 (a local store;
            the options refuse it for a sharded one).
        fused: FP16Optimizer's ``fused`` (True: the fused step or a one-line error;
            None: when supported and either the model has at least
            :data:`FUSED_MIN_NUMEL` parameters or the inner optimizer asked for torch's
            fast step; False: never).
        state_dtypes, state_rounding: the inner optimizer's states kept in 16 bits
            (mpfp16.options.state_dtypes_of; a local store), and how they are rounded.

    Raises:
        ValueError: ``fused=True`` where the optimizer or the store cannot take it.
    """
    reason = unsupported_reason(optimizer)
    if fused and reason:
        raise ValueError(f"fused=True is not possible: {reason}")
    if holds_sharded(params):
        store = ShardedStore(optimizer, params, model)
    else:
        store = build_local_store(optimizer, params, master_weights=master_weights, rounding=rounding,
                                  accumulate=accumulate, state_dtypes=state_dtypes, state_rounding=state_rounding)
    reason = reason or store.fused_unsupported()
    if fused and reason:
        raise ValueError(f"fused=True is not possible: {reason}")
    if is_main_process():  # flat buffers are the rule; say so only when another store was chosen
        logger.log(logging.DEBUG if store.kind == "flat" else logging.INFO, "FP16Optimizer: %s", store.explain())
    asked = fast_path_flag(optimizer)  # the inner optimizer's fused=True / foreach=True
    numel = sum(p.numel() for p in params)
    big = numel >= FUSED_MIN_NUMEL
    use_fused = fused if fused is not None else (reason is None and (big or asked is not None))
    optimizer_reason = unsupported_reason(optimizer)
    # Said where the fused step was asked for (the inner optimizer's flag), or where its
    # size would have chosen it and the optimizer is what stands in the way (a store that
    # cannot take it said so in its own line above); fused=False asks for nothing.
    if not use_fused and is_main_process() and (asked or (fused is None and big and optimizer_reason is not None)):
        _explain_no_fused_step(optimizer, asked, optimizer_reason, store.fused_unsupported(), numel)
    if use_fused:
        store.use_fused(fused is True)
    return store


def _explain_no_fused_step(optimizer, asked: str | None, optimizer_reason: str | None, store_reason: str | None,
                           numel: int) -> None:
    """One line for an inner optimizer built with fused=True or foreach=True whose
    step is not mpfp16's fused one: its own step then runs over the fp32 masters; and,
    with ``asked`` None, for one that FP16Optimizer(fused=None) would have given the
    fused step for its size (``numel`` >= :data:`FUSED_MIN_NUMEL`) but cannot take
    (``optimizer_reason``: torchao's low-bit optimizers, RMSprop, amsgrad=True): its own
    step runs, an INFO line, since nothing was asked for."""
    name = type(optimizer).__name__
    if asked is None:
        logger.info("%s over %d parameters: mpfp16's fused step cannot take it (%s); %s's own step runs", name,
                    numel, optimizer_reason, name)
        return
    own = f"torch's own {asked.split('=')[0]} step runs over the fp32 masters"
    if optimizer_reason is not None:
        logger.warning("%s(%s): mpfp16's fused step cannot take it (%s); %s", name, asked, optimizer_reason, own)
    elif store_reason is not None:
        logger.info("%s(%s): %s (mpfp16's fused step: %s)", name, asked, own, store_reason)
    else:  # FP16Optimizer(fused=False)
        logger.info("%s(%s) under FP16Optimizer(fused=False): %s, not mpfp16's fused step", name, asked, own)
