"""Optimizer states kept in 16 bits (``FP16Optimizer(state_dtype=torch.bfloat16)``).

The inner optimizer's per-parameter states (SGD's ``momentum_buffer``; Adam's and
AdamW's ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) are kept in bf16 between steps;
each step computes in fp32 from them and rounds the new states once, to nearest or
stochastically (mpfp16.rounding.stochastic_round, drawn from the optimizer's rounding
generator, whose state the state_dict keeps). The fused kernels read and write the
16-bit states directly (mpfp16/stores/fused.py). The inner optimizer's own step (the
unfused path) works in fp32 alone, so :class:`StateKeeper` widens the states of a
bounded chunk of parameters at a time, steps that chunk, and rounds them back: the
fp32 copies of at most :data:`CHUNK_NUMEL` parameters' states exist at once, whatever
the model's size, so the saving holds at the step's peak, up to that bound. The inner
optimizer's step hooks still run once a step, and see every gradient.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..rounding import stochastic_round
from .interface import HiddenGradients

__all__ = ["StateKeeper", "CHUNK_NUMEL", "round_state"]

CHUNK_NUMEL = 1 << 22  # parameters whose states are widened to fp32 at once by the unfused step (16 MiB a state)


def round_state(value: torch.Tensor, dtype: torch.dtype, rounding: str, rng: torch.Generator | None) -> torch.Tensor:
    """fp32 ``value`` as a state of ``dtype``: rounded to nearest (even), or
    stochastically with noise drawn from ``rng``."""
    if dtype == value.dtype:
        return value
    if rounding == "stochastic":
        noise = torch.rand(value.shape, generator=rng, device=value.device)
        return stochastic_round(value.float(), noise, dtype)
    return value.to(dtype)


class StateKeeper:
    """Keeps the inner optimizer's states in ``dtypes`` (``{name: dtype}`` of the states
    not kept in fp32) between the steps of its own ``step()``.

    Args:
        optimizer: the inner optimizer.
        dtypes: the states kept in 16 bits, by name.
        rounding: ``"nearest"`` or ``"stochastic"``, how a new state is rounded.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dtypes: dict[str, torch.dtype], rounding: str) -> None:
        self.optimizer, self.dtypes, self.rounding = optimizer, dict(dtypes), rounding

    def step(self, stepped: list[torch.Tensor], trainable: list[bool], rng: torch.Generator) -> None:
        """The inner optimizer's step over the masters ``stepped`` (``trainable``: which
        require grad now; the others are left alone, as a parameter without a gradient
        is), a chunk of at most :data:`CHUNK_NUMEL` parameters at a time: each chunk's
        states widened to fp32, the chunk stepped with the others' gradients hidden,
        its new states rounded back."""
        live = [m for m, t in zip(stepped, trainable) if t and m.grad is not None]
        chunks = _chunks(live, CHUNK_NUMEL)
        for i, chunk in enumerate(chunks):
            members = {id(m) for m in chunk}
            others = HiddenGradients(m for m in stepped if id(m) not in members)

            def before(chunk=chunk, others=others):
                others.hide()
                self._widen(chunk)

            if len(chunks) == 1:
                before()
                try:
                    self.optimizer.step()
                finally:
                    others.restore()
            else:
                _step_with_hooks_once(self.optimizer, i == 0, i == len(chunks) - 1, before, others.restore)
            self._narrow(chunk, self.rounding, rng)

    def _widen(self, params: list[torch.Tensor]) -> None:
        state = self.optimizer.state
        for p in params:
            entry = state.get(p)
            for name in self.dtypes:
                t = entry.get(name) if entry else None
                if t is not None and t.dtype != torch.float32:
                    entry[name] = t.float()

    def _narrow(self, params: list[torch.Tensor], rounding: str, rng: torch.Generator | None) -> None:
        state = self.optimizer.state
        for p in params:
            entry = state.get(p)
            for name, dtype in self.dtypes.items():
                t = entry.get(name) if entry else None
                if t is not None and t.dtype != dtype:
                    entry[name] = round_state(t, dtype, rounding, rng)

    def keep(self, params: list[torch.Tensor]) -> None:
        """After the inner optimizer loaded a state (torch's load makes every floating
        state its parameter's dtype, fp32): round the states to their dtypes, to
        nearest."""
        self._narrow(params, "nearest", None)


def _step_with_hooks_once(optimizer: torch.optim.Optimizer, first: bool, last: bool, before, after) -> None:
    """One of the inner optimizer's ``step()`` calls of a step taken in chunks, its step
    hooks run as for the one call an unchunked step makes: the pre-hooks (torch's global
    ones, then the optimizer's) at the first chunk only, the post-hooks at the last only.
    ``before()`` hides the other chunks' gradients after the pre-hooks ran, so that those
    see every gradient, as a whole step shows them; ``after()`` restores them before the
    post-hooks run, and whatever the step raised."""
    from torch.optim import optimizer as module  # the global hooks are this module's

    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    global_pre, global_post = module._global_optimizer_pre_hooks, module._global_optimizer_post_hooks
    restored = False

    def restore(*_):
        nonlocal restored
        if not restored:
            restored = True
            after()

    optimizer._optimizer_step_pre_hooks = OrderedDict([*(pre.items() if first else ()),
                                                       ("mpfp16-chunk", lambda *_: before())])
    optimizer._optimizer_step_post_hooks = OrderedDict([("mpfp16-chunk", restore), *(post.items() if last else ())])
    module._global_optimizer_pre_hooks = global_pre if first else OrderedDict()
    module._global_optimizer_post_hooks = global_post if last else OrderedDict()
    try:
        optimizer.step()
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post
        module._global_optimizer_pre_hooks, module._global_optimizer_post_hooks = global_pre, global_post
        restore()


def _chunks(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``params`` in consecutive runs of at most ``limit`` elements (a larger one alone)."""
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        if not chunks or size + p.numel() > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel()
    return chunks
