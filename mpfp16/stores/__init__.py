"""Parameter stores: where the parameters an FP16Optimizer steps live
(mpfp16/stores/interface.py has the interface). :func:`build_store` chooses one from the
parameters and makes it ready to step (mpfp16/stores/build.py):

- local (mpfp16/stores/local.py), flat: parameters, gradients and fp32 masters in flat
  buffers (mpfp16/stores/groups.py), with the unfused step or the fused kernels
  (mpfp16/stores/fused.py), the flat store's backend;
- local, per-tensor: 16-bit parameters that can no longer move into a flat buffer (a
  ``.half()`` model already held by DDP) stay where they are, in groups of their own;
  foreach ops over the tensors, the same numbers bit for bit;
- sharded (mpfp16/stores/sharded.py): FSDP2's sharded fp32 DTensors are the masters.

This package is the whole layout boundary: the optimizer imports it alone.
"""

from __future__ import annotations

from .build import FUSED_MIN_NUMEL, build_store, store_type
from .groups import is_master
from .interface import ParamStore

__all__ = ["ParamStore", "build_store", "store_type", "is_master", "FUSED_MIN_NUMEL"]
