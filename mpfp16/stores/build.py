"""The one way a store is made: the registry of the kinds of store, and the choice.

:data:`STORES` lists every kind of store; :func:`store_type` takes the first that
claims the parameters (``ParamStore.claims``): sharded for FSDP2's DTensors, else
local (flat, or per-tensor where parameters can no longer move). A new kind of store
(a CPU-offload store, say) is one file with its :class:`~mpfp16.stores.interface.ParamStore`
subclass and one line here; FP16Optimizer, the options and the front ends know stores
only through the interface.
"""

from __future__ import annotations

import logging

import torch

from ..parallel.ranks import is_main_process
from .interface import ParamStore, StoreOptions
from .local import LocalStore
from .sharded import ShardedStore

__all__ = ["STORES", "build_store", "store_type"]

logger = logging.getLogger("mpfp16")

# Every kind of store, asked in this order whether it claims the parameters.
STORES: tuple[type[ParamStore], ...] = (
    ShardedStore,  # FSDP2's sharded fp32 DTensors are the masters
    LocalStore,  # one process's parameters, in flat buffers or where they are
)


def store_type(params: list[torch.Tensor]) -> type[ParamStore]:
    """The kind of store ``params`` need, before anything is placed."""
    return next(kind for kind in STORES if kind.claims(params))


def build_store(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], options: StoreOptions) -> ParamStore:
    """The store for ``params`` (every parameter ``optimizer`` holds, in its order),
    ready to step, with one log line that says which where it is not the flat store.

    Raises:
        ValueError: one line, where the kind of store refuses the optimizer or the
            options (``ParamStore.refusal``; ``fused=True`` it cannot take).
    """
    kind = store_type(params)
    refusal = kind.refusal(optimizer, options)
    if refusal:
        raise ValueError(refusal)
    store = kind(optimizer, params, options)
    if is_main_process():  # flat buffers are the rule; say so only when another store was chosen
        logger.log(logging.DEBUG if store.kind == "flat" else logging.INFO, "FP16Optimizer: %s", store.description)
    return store
