"""The store of one process's parameters: groups with fp32 masters in flat buffers
(mpfp16/stores/groups.py), the model's tensors in flat buffers or where they are.

One class, two kinds, by its groups: ``"flat"`` when every group's parameters are in a
flat buffer, ``"per-tensor"`` when some could no longer move into one (a ``.half()``
model that DDP already holds): those stay where they are, in groups of their own, with
the same numbers bit for bit; the cost is a foreach copy over the tensors where a flat
group makes one copy, and no fused step.

The step is the inner optimizer's own ``step()`` over the masters, or, after
:meth:`LocalStore.use_fused`, mpfp16's fused kernels (mpfp16/stores/fused.py), the
flat store's backend. The store also owns their compile, and the agreement across
ranks about it (:meth:`LocalStore.prepare`): a compile can fail on one rank only, and
every rank must then take the same path.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from .. import flat_buffers
from ..errors import FusedStepUnavailable, compile_errors, one_line
from ..parallel.ranks import failures, is_main_process
from .groups import ParamGroup
from .state_dtypes import StateKeeper
from .interface import ParamStore, find_nonfinite, storage_bytes, total_norm, unscale_and_check, whole

__all__ = ["LocalStore", "build_local_store"]

logger = logging.getLogger("mpfp16")


@contextlib.contextmanager
def _frozen_skipped(stepped: list[torch.Tensor], params: list[torch.Tensor]):
    """Inside: the masters of parameters that do not require grad now have no
    ``.grad``, so the inner optimizer leaves them, their momentum and their step
    counters alone, as it leaves a parameter without a gradient."""
    hidden = [(m, m.grad) for m, p in zip(stepped, params) if not p.requires_grad and m.grad is not None]
    for m, _ in hidden:
        m.grad = None
    try:
        yield
    finally:
        for m, grad in hidden:
            m.grad = grad


class LocalStore(ParamStore):
    """The parameters of one process (module docstring).

    Args:
        optimizer: the inner optimizer.
        params: every parameter it holds, in its order.
        groups: the groups those parameters were placed in (:func:`build_local_store`).
        rounding: without master weights, how new weights are rounded to 16 bits.
        why: why some parameters stay where they are (a per-tensor store), or None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], groups: list[ParamGroup],
                 rounding: str, why: str | None = None, state_dtypes: dict | None = None,
                 state_rounding: str = "nearest") -> None:
        super().__init__()
        self.optimizer, self.groups, self.rounding, self.why = optimizer, groups, rounding, why
        self.state_dtypes, self.state_rounding = dict(state_dtypes or {}), state_rounding
        self._keeper = StateKeeper(optimizer, self.state_dtypes, state_rounding) if self.state_dtypes else None
        self.kind = "per-tensor" if any(g.side.per_tensor for g in groups) else "flat"
        self.accumulates = any(g.accumulating for g in groups)
        self.params = list(params)
        to_master = {id(p): m for g in groups for p, m in zip(g.params, g.master_views)}
        self.stepped = [to_master[id(p)] for p in params]
        self.has_fp16 = any(p.dtype == torch.float16 for p in params)
        self.compute_dtype = next((d for d in (torch.float16, torch.bfloat16) if any(p.dtype == d for p in params)),
                                  torch.float32)
        self.has_half = any(g.half for g in groups)
        self.device = groups[0].device
        self._fused = None
        self._noise: list = [None] * len(groups)
        self._prepared: set[tuple[bool, bool]] = set()  # (fp32_grads, with_norm) the kernels are compiled for
        self._fused_requested = False

    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    def explain(self) -> str:
        if self.kind == "per-tensor":
            stay = sum(len(g.params) for g in self.groups if g.side.per_tensor)
            return (f"per-tensor store: {stay} of {len(self.params)} parameters stay where they are, because "
                    f"{self.why}; foreach ops over the tensors, the same numbers as flat buffers")
        n = len(self.groups)
        return f"flat store: {len(self.params)} parameters in {n} flat buffer{'s' * (n != 1)}"

    # ---------------------------------------------------------------- the fused step

    def fused_unsupported(self) -> str | None:
        if self.kind == "per-tensor":
            return "its parameters are not in flat buffers (they could no longer move: build FP16Optimizer before DDP)"
        return None

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def use_fused(self, requested: bool) -> None:
        """Step with the fused kernels from now on. ``requested``: the user asked for
        them (``fused=True``), so a compile that fails raises instead of falling back."""
        from .fused import FusedStep

        self._fused = FusedStep(self.optimizer, self.groups, self.stepped, self.rounding, self.state_dtypes,
                                self.state_rounding)
        self._fused_requested = requested

    def use_unfused(self) -> None:
        self._fused = None

    def prepare(self, fp32_grads: bool, with_norm: bool = False, group=None, agree: bool = True) -> None:
        """Before the first step that needs them: compile the fused kernels (those that
        read the 16-bit gradients, or with ``fp32_grads`` also those that read the fp32
        gradients ``unscale_()`` makes; with ``with_norm`` the overflow check's variants
        that also sum the squares for the norm), and make every rank take the same path.

        The outcome is gathered across the group before anything is written. If any
        rank failed, ``fused=True`` raises on every rank, naming the ranks and the
        reason; ``fused=None`` moves every rank to the unfused step, with one warning.
        ``group``, ``agree``: the ranks that take one path, and whether to ask them (not
        when this rank steps alone). Errors other than compile errors are not caught."""
        if self._fused is None or (fp32_grads, with_norm) in self._prepared or (fp32_grads, True) in self._prepared:
            return
        error = None
        started = time.perf_counter()
        if is_main_process():  # the first step waits for this: say why, once per kernel set
            logger.info("fused step: compiling its kernels%s (they are kept on disk, so a later run starts sooner)",
                        " for unscale_()'s fp32 gradients" if fp32_grads else "")
        try:
            self._fused.prepare(fp32_grads=fp32_grads, with_norm=with_norm)
        except compile_errors() as exc:  # evaluated only when prepare() raised
            error = f"{type(exc).__name__}: {one_line(exc)}"
        found = failures(error, group=group) if agree else ({0: error} if error is not None else {})
        if not found:
            if is_main_process():
                logger.info("fused step: kernels ready in %.1f s", time.perf_counter() - started)
            self._prepared.add((fp32_grads, with_norm))
            if fp32_grads:
                self._prepared.add((False, with_norm))  # prepare(fp32_grads=True) compiles the 16-bit variants too
            return
        where = ", ".join(f"rank {rank}" for rank in found)
        reason = next(iter(found.values()))
        if self._fused_requested:
            raise FusedStepUnavailable(f"fused=True cannot be honoured: compiling the fused step failed on {where} "
                                       f"({reason})")
        if is_main_process():
            logger.warning("fused optimizer step unavailable: compiling failed on %s (%s); every rank uses the "
                           "unfused step", where, reason)
        self.use_unfused()

    def invalidate(self) -> None:
        if self._fused is not None:
            self._fused.invalidate()  # its next step adopts the states into its flat buffers, in their dtypes
        elif self._keeper is not None:
            self._keeper.keep(self.stepped)

    # ---------------------------------------------------------------- the phases

    def check_ready(self) -> None:
        for g in self.groups:
            g.check_params()

    def zero_grad(self, set_to_none: bool) -> None:
        for g in self.groups:
            g.zero_grads(set_to_none)

    def sum_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p, s) for g in self.groups if g.accumulating for p, s in zip(g.params, g.sum_views())]

    def open_sums(self) -> None:
        for g in self.groups:
            if g.accumulating:
                g.open_sum()

    def accumulate(self) -> None:
        for g in self.groups:
            if g.accumulating:
                g.accumulate()

    def unscale(self, state, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        state.materialized = materialize
        if self._fused is not None:
            return self._fused.unscale(state, scale, materialize, with_norm)
        for g in self.groups:
            g.ready_fp32_grads()
        return unscale_and_check([t for g in self.groups for t in g.fp32_grads()], scale)

    def nonfinite_grads(self, state, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """Of the gradients the step read: a 16-bit group's fp32 ones where the step
        copied them there (the unfused step; the fused one after ``unscale_()``) or sums
        them there (fp32 accumulation), else the model's own."""
        fp32 = not before_unscale and (self._fused is None or state.materialized)
        position = {id(p): i for i, p in enumerate(self.params)}
        return find_nonfinite(((position[id(p)], grad) for g in self.groups for p, grad in
                               zip(g.params, g.grads_read(fp32 or g.accumulating))), limit)

    def grad_norm(self, state) -> torch.Tensor:
        if self._fused is not None and not state.materialized:
            return self._fused.grad_norm(state)
        return total_norm([m.grad for m, p in zip(self.stepped, self.params) if p.requires_grad])

    def update(self, state, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        self._noise = [torch.rand(g.layout.total, generator=rng, device=g.device)
                       if self.rounding == "stochastic" and g.half else None for g in self.groups]
        if self._fused is not None:
            self._fused.update(state, scale, clip_coef, self._noise, rng)
            return
        if clip_coef is not None:  # what clip_grads_with_norm_ does, one multiply per buffer
            for g in self.groups:
                torch._foreach_mul_(g.fp32_grads(), clip_coef.to(g.device))
        for g in self.groups:
            if g.transient:
                g.master_from_weights()
        if self._keeper is not None:  # 16-bit states: widened a bounded chunk at a time
            self._keeper.step(self.stepped, [p.requires_grad for p in self.params], rng)
            return
        with _frozen_skipped(self.stepped, self.params):
            self.optimizer.step()

    def copy_back(self) -> None:
        """Round the fp32 masters into the 16-bit model, one copy per buffer (without
        master weights, with the chosen rounding); the fused kernels wrote them already."""
        for g, noise in zip(self.groups, self._noise):
            if g.half and self._fused is None:
                if g.transient:
                    g.write_rounded(noise, self.rounding)
                else:
                    g.copy_back()
            g.release()
        self._noise = [None] * len(self.groups)

    def skip(self) -> None:
        for g in self.groups:
            g.release()

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        for g in self.groups:
            if g.has_master:
                g.copy_back()

    # ---------------------------------------------------------------- memory and state

    def memory(self) -> dict[str, float]:
        numel = max(1, self.numel)
        halves = [g for g in self.groups if g.half]
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        report = {
            "model_weights": storage_bytes(t for g in self.groups for t in g.weight_parts()) / numel,
            "model_grads": storage_bytes(t for g in self.groups for t in g.model_grads()) / numel,
            "master_weights": storage_bytes(g.master for g in halves) / numel,
            "master_grads": storage_bytes(g.master_grads for g in halves) / numel,
            "optimizer_state": storage_bytes(state) / numel,
            "compensation": storage_bytes(g.comp for g in halves if g.comp is not None) / numel,
            "master_remainder": storage_bytes(g.remainder for g in halves if g.remainder is not None) / numel,
        }
        report["total"] = sum(report.values())
        return report

    def param_state(self) -> list[dict]:
        """Per parameter: its fp32 value (the master, rebuilt exactly with remainders;
        the parameter itself where it is fp32; None without master weights) and, with
        Kahan rounding, its compensation."""
        entries = [{"master": p.detach() if p.dtype == torch.float32 else None} for p in self.params]
        position = {id(p): i for i, p in enumerate(self.params)}
        for g in self.groups:
            if not g.half:
                continue
            masters = (g.master_views if g.has_master else g.rebuilt_masters() if g.remainder is not None
                       else [None] * len(g.params))
            comps = self.layout_views(g, g.comp)
            for p, m, c in zip(g.params, masters, comps):
                entries[position[id(p)]]["master"] = m
                if c is not None:
                    entries[position[id(p)]]["compensation"] = c
        return entries

    @staticmethod
    def layout_views(g: ParamGroup, buffer: torch.Tensor | None) -> list:
        return g.layout.views(buffer) if buffer is not None else [None] * len(g.params)

    def check_state(self, entries: list[dict], legacy: dict) -> None:
        """Raise one line where a Kahan compensation this store keeps is not in the state
        (or, in a state of the second form, one buffer per group, of another size)."""
        saved = legacy.get("kahan_compensation")
        position = {id(p): i for i, p in enumerate(self.params)}
        for gi, g in enumerate(self.groups):
            if g.comp is None:
                continue
            if saved is not None:
                comp = saved[gi] if gi < len(saved) else None
                if comp is None or comp.shape != g.comp.shape:
                    found = "none" if comp is None else f"{comp.numel()} elements"
                    raise ValueError(f"Kahan compensation buffer {gi} has {found} in the state_dict and "
                                     f"{g.comp.numel()} here")
                continue
            for p in g.params:
                comp = entries[position[id(p)]].get("compensation")
                if comp is None or tuple(comp.shape) != tuple(p.shape):
                    raise ValueError(f"parameter {position[id(p)]} has no Kahan compensation of its shape in the "
                                     "state_dict")

    def like_stepped(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """A saved per-parameter tensor (plain, or a sharded store's DTensor) as this
        store steps it: whole, on the parameter's device."""
        return whole(t).to(self.stepped[index].device)

    @torch.no_grad()
    def load_state(self, entries: list[dict], legacy: dict) -> None:
        """The saved masters (the model's own weights where none were saved), and the
        16-bit weights set from them, so the two always agree; with remainders, the
        weights and remainders that hold the saved masters exactly."""
        position = {id(p): i for i, p in enumerate(self.params)}
        saved_comp = legacy.get("kahan_compensation")
        for gi, g in enumerate(self.groups):
            saved = [entries[position[id(p)]].get("master") for p in g.params]
            saved = [whole(m) if m is not None else None for m in saved]
            if g.comp is not None:
                if saved_comp is not None:
                    g.comp.copy_(saved_comp[gi])
                else:
                    for view, p in zip(g.layout.views(g.comp), g.params):
                        view.copy_(whole(entries[position[id(p)]]["compensation"]))
            if not g.half:
                for p, m in zip(g.params, saved):
                    if m is not None:
                        p.copy_(m)
            elif g.has_master:
                for p, view, m in zip(g.params, g.master_views, saved):
                    view.copy_(p if m is None else m)
                g.copy_back()
            elif g.remainder is not None:
                g.split_into_weights(saved)
            g.mark_synced()  # the model was loaded first: its weights are not stale


def build_local_store(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, master_weights: bool | str,
                      rounding: str, accumulate: bool = False, state_dtypes: dict | None = None,
                      state_rounding: str = "nearest") -> LocalStore:
    """Place ``params`` (every parameter ``optimizer`` holds, in its order) and return
    the store: flat when every one is, or can be, in a flat buffer, else per-tensor, in
    which those that cannot move stay where they are. Parameters of one (device, dtype)
    fill whole buffers: those that :func:`mpfp16.to_half` made are adopted as they are,
    the rest move into new ones."""
    group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    kahan = rounding == "kahan"
    groups: list[ParamGroup] = []
    why = None
    for ps in flat_buffers.by_key(params).values():
        try:
            placed = flat_buffers.place(ps)
        except flat_buffers.NotMovable as exc:
            why = "DistributedDataParallel (or another gradient hook) already holds them"
            logger.debug("%s", exc)
            groups += [ParamGroup.per_tensor(sub, master_weights, group_of, kahan, accumulate)
                       for sub in flat_buffers.by_key(ps, frozen_apart=True).values()]
            continue
        groups += [ParamGroup.flat(fp, master_weights, group_of, kahan, accumulate) for fp in placed]
    return LocalStore(optimizer, params, groups, rounding, why, state_dtypes, state_rounding)
