"""Parameter stores: where the parameters an FP16Optimizer steps live
(mpfp16/stores/interface.py has the interface; mpfp16/stores/build.py the registry).
:func:`build_store` chooses one from the parameters and makes it ready to step:

- local (mpfp16/stores/local.py), flat: parameters, gradients and fp32 masters in flat
  buffers (mpfp16/stores/groups.py), with the unfused step or the fused kernels
  (mpfp16/stores/fused.py, on the inner optimizer's own state: mpfp16/stores/flat_state.py);
- local, per-tensor: 16-bit parameters that can no longer move into a flat buffer (a
  ``.half()`` model already held by DDP) stay where they are, in groups of their own;
  foreach ops over the tensors, the same numbers bit for bit;
- sharded (mpfp16/stores/sharded.py): FSDP2's sharded fp32 DTensors are the masters.

Every one is proven equal to the per-tensor definition of the step
(:mod:`mpfp16.reference`) by tests/test_store_conformance.py. This package is the whole
layout boundary: the optimizer imports it alone.
"""

from __future__ import annotations

from .build import STORES, build_store, store_type
from .fused import FUSED_MIN_NUMEL
from .groups import is_master
from .interface import Checked, ParamStore, StoreOptions
from .nonfinite import any_nonfinite, nonfinite_flags
from .sharded import ShardedStore
from .state_rules import STATE_NAMES, has_own_step, known_base, state_names

__all__ = ["ParamStore", "StoreOptions", "Checked", "STORES", "build_store", "store_type", "is_master",
           "FUSED_MIN_NUMEL", "any_nonfinite", "nonfinite_flags", "ShardedStore", "STATE_NAMES", "has_own_step",
           "known_base", "state_names"]
