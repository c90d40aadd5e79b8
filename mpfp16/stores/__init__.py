"""Parameter stores: where the parameters an FP16Optimizer steps live (mpfp16/stores/base.py
has the interface). One is chosen from the parameters:

- flat (mpfp16/stores/flat.py): parameters, gradients and fp32 masters in flat buffers,
  with the unfused step or the fused kernels (mpfp16/stores/fused.py);
- per-tensor (mpfp16/stores/flat.py): 16-bit parameters that can no longer move into a
  flat buffer (a ``.half()`` model already held by DDP) stay where they are; foreach
  ops over the tensors, the same numbers bit for bit;
- sharded (mpfp16/stores/sharded.py): FSDP2's sharded fp32 DTensors are the masters.
"""

from __future__ import annotations

import torch

from .base import ParamStore
from .flat import build_local_store
from .sharded import ShardedStore, holds_sharded

__all__ = ["ParamStore", "build_store", "store_type"]


def store_type(params: list[torch.Tensor]) -> type[ParamStore]:
    """The kind of store ``params`` need, before anything is placed: sharded for
    DTensors, else a local one (flat or per-tensor, decided while placing)."""
    from .flat import FlatStore

    return ShardedStore if holds_sharded(params) else FlatStore


def build_store(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, model, master_weights: bool | str,
                rounding: str, accumulate: bool = False) -> ParamStore:
    """The store for ``params`` (every parameter ``optimizer`` holds, in its order);
    ``accumulate``: sum the micro-batches' 16-bit gradients in fp32 (a local store;
    the optimizer's options refuse it for a sharded one)."""
    if holds_sharded(params):
        return ShardedStore(optimizer, params, model)
    return build_local_store(optimizer, params, master_weights=master_weights, rounding=rounding,
                             accumulate=accumulate)
