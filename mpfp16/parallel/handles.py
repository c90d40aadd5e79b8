"""One handle per model that :func:`mpfp16.distributed.wrap` or
:func:`mpfp16.distributed.shard` returned: how it communicates, recorded beside the
model instead of on it.

``comm_stats``, ``sync_gradients``, the comm-state checkpoints and the sharded
optimizer store ask :func:`handle_of` instead of looking for attributes on the user's
module. The registry holds each module weakly and compares modules by identity (a
``WeakIdKeyDictionary``: an ``nn.Module`` may define ``__eq__``, a tensor's ``==`` is
elementwise), so a handle lives exactly as long as its model, and nothing mpfp16 adds
travels with the model when it is pickled or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Handle", "register", "handle_of", "KINDS"]

KINDS = ("ddp", "sharded")


@dataclass
class Handle:
    """What mpfp16 knows about one wrapped or sharded model.

    Attributes:
        kind: ``"ddp"`` (made by ``wrap``) or ``"sharded"`` (made by ``shard``).
        stats: its per-step communication figures: a
            :class:`mpfp16.parallel.hooks.CommStats` (ddp) or a
            :class:`mpfp16.parallel.fsdp.ShardCommStats` (sharded).
        group: the process group it communicates over (ddp: the one given to
            ``wrap``, None for the default group; sharded: its mesh's group).
        hook_state: ddp: the communication hook's
            :class:`mpfp16.parallel.hooks.HookState`.
        param_dtype: sharded: the compute and all-gather dtype.
        sync: sharded: whether the next backward reduce-scatters its gradients
            (False inside ``sync_gradients(model, False)``).
    """

    kind: str
    stats: object
    group: object
    hook_state: object = None
    param_dtype: torch.dtype | None = None
    sync: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a handle's kind is one of {', '.join(KINDS)}, not {self.kind!r}")


_HANDLES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(module: torch.nn.Module, handle: Handle) -> Handle:
    """Record ``handle`` for ``module`` (the module ``wrap``/``shard`` returns);
    returns ``handle``."""
    _HANDLES[module] = handle
    return handle


def handle_of(module) -> Handle | None:
    """The handle of ``module``, exactly the module ``wrap``/``shard`` returned (a DDP
    module's inner module has none); None for any other object."""
    try:
        return _HANDLES.get(module)
    except TypeError:  # an object that cannot be referenced weakly was never registered
        return None
