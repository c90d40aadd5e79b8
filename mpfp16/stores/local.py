"""The store of one process's parameters: groups with fp32 masters in flat buffers
(mpfp16/stores/groups.py), the model's tensors in flat buffers or where they are.

One class, two kinds, by its groups: ``"flat"`` when every group's parameters are in a
flat buffer, ``"per-tensor"`` when some could no longer move into one (a ``.half()``
model that DDP already holds): those stay where they are, in groups of their own, with
the same numbers bit for bit; the cost is a foreach copy over the tensors where a flat
group makes one copy, and no fused step.

The step is the inner optimizer's own ``step()`` over the masters, or mpfp16's fused
kernels (mpfp16/stores/fused.py), the flat store's backend, chosen when the store is
built (:func:`mpfp16.stores.fused.choose_fused`). The store also owns their compile,
and the agreement across ranks about it (:meth:`LocalStore.check`): a compile can fail
on one rank only, and every rank must then take the same path. Either step steps the
inner optimizer's own state, checked first by mpfp16/stores/state_rules.py.
"""

from __future__ import annotations

import logging
import time

import torch

from .. import flat_buffers
from ..errors import FusedStepUnavailable, compile_errors, dtype_name, one_line
from ..parallel.fsdp_shim import is_sharded, whole
from ..parallel.ranks import failures, is_main_process
from .fused import FusedStep, choose_fused, unsupported_reason
from .groups import ParamGroup
from .interface import Checked, HiddenGradients, ParamStore, StoreOptions, storage_bytes, total_norm
from .nonfinite import find_nonfinite, unscale_and_check
from .state_dtypes import StateKeeper
from .state_rules import settle, state_problem

__all__ = ["LocalStore"]

logger = logging.getLogger("mpfp16")


def _place(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], options: StoreOptions):
    """``params`` (every parameter ``optimizer`` holds, in its order) in groups: flat
    where every one is, or can be, in a flat buffer; else those that cannot move stay
    where they are, in groups of their own. Parameters of one (device, dtype) fill whole
    buffers: those that :func:`mpfp16.to_half` made are adopted as they are, the rest
    move into new ones. Returns the groups and why some stay (None: none does)."""
    group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    kahan, accumulate = options.rounding == "kahan", options.accumulate
    groups: list[ParamGroup] = []
    why = None
    for ps in flat_buffers.by_key(params).values():
        try:
            placed = flat_buffers.place(ps)
        except flat_buffers.NotMovable as exc:
            why = "DistributedDataParallel (or another gradient hook) already holds them"
            logger.debug("%s", exc)
            groups += [ParamGroup.per_tensor(sub, options.master_weights, group_of, kahan, accumulate)
                       for sub in flat_buffers.by_key(ps, frozen_apart=True).values()]
            continue
        groups += [ParamGroup.flat(fp, options.master_weights, group_of, kahan, accumulate) for fp in placed]
    return groups, why


class LocalStore(ParamStore):
    """The parameters of one process (module docstring).

    Args:
        optimizer: the inner optimizer.
        params: every parameter it holds, in its order.
        options: what FP16Optimizer asks of it.
    """

    @classmethod
    def claims(cls, params: list[torch.Tensor]) -> bool:
        return not any(is_sharded(p) for p in params)

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], options: StoreOptions) -> None:
        super().__init__()
        groups, self._why = _place(optimizer, params, options)
        self.optimizer, self.groups, self.rounding = optimizer, groups, options.rounding
        self.state_dtypes, self.state_rounding = dict(options.state_dtypes), options.state_rounding
        self._keeper = StateKeeper(optimizer, self.state_dtypes, self.state_rounding) if self.state_dtypes else None
        self.kind = "per-tensor" if any(g.side.per_tensor for g in groups) else "flat"
        self.accumulates = any(g.accumulating for g in groups)
        self.params = list(params)
        to_master = {id(p): m for g in groups for p, m in zip(g.params, g.master_views)}
        self.stepped = [to_master[id(p)] for p in params]
        self.dtypes = [dtype_name(p.dtype) for p in params]
        self.labels = list(options.labels) or [f"param {i} {list(p.shape)}" for i, p in enumerate(params)]
        self.compute_dtype = next((d for d in (torch.float16, torch.bfloat16) if any(p.dtype == d for p in params)),
                                  torch.float32)
        self.has_half = any(g.half for g in groups)
        self.device = groups[0].device
        self.sums = [(p, s) for g in groups if g.accumulating for p, s in zip(g.params, g.sum_views())]
        self.description = self._describe()
        self._noise: list = [None] * len(groups)
        self._pending: str | None = None  # what the last update() left copy_back() to do
        self._ready: set = set()  # the fused kernels built (FusedStep.variants' keys)
        self._fused = None
        self._fused_requested = options.fused is True
        store_reason = ("its parameters are not in flat buffers (they could no longer move: build FP16Optimizer "
                        "before DDP)") if self.kind == "per-tensor" else None
        if choose_fused(optimizer, sum(p.numel() for p in params), options.fused, store_reason):
            self._fused = FusedStep(optimizer, groups, self.rounding, self.state_dtypes, self.state_rounding)

    def _describe(self) -> str:
        if self.kind == "per-tensor":
            stay = sum(len(g.params) for g in self.groups if g.side.per_tensor)
            return (f"per-tensor store: {stay} of {len(self.params)} parameters stay where they are, because "
                    f"{self._why}; foreach ops over the tensors, the same numbers as flat buffers")
        n = len(self.groups)
        return f"flat store: {len(self.params)} parameters in {n} flat buffer{'s' * (n != 1)}"

    @property
    def fused(self) -> bool:
        return self._fused is not None

    # ---------------------------------------------------------------- phase 1

    def check(self, *, fp32_grads: bool, with_norm: bool, group=None, agree: bool = True) -> None:
        """Every parameter in its place; the state steppable (mpfp16/stores/state_rules.py);
        with the fused step, the inner optimizer's groups still such that the kernels can
        step them, and the kernels the step needs built, agreed across ``group``'s ranks
        (:meth:`_build`)."""
        for g in self.groups:
            g.check_params()
        self.check_state()
        if self._fused is not None:
            self._build(fp32_grads, with_norm, group, agree)
        return None

    def check_state(self) -> None:
        """The guard of the state's one owner: the inner optimizer's state and groups such
        that the step about to run steps them as torch would (a cleared, assigned or
        loaded state adopted; one it cannot step refused in one line, before anything
        moves). With the fused step, while nothing changed, a few identity tests per
        parameter (``python -m mpfp16.bench.step``, row n)."""
        if self._fused is not None:
            self._still_fusable()
        if self._fused is not None:
            problem = self._fused.problem(self.stepped, self.params, self.labels)
        else:
            problem = state_problem(self.optimizer, self.stepped, self.params, self.labels)
        if problem is not None:
            raise RuntimeError(problem)

    def _still_fusable(self) -> None:
        """A param group changed since the store was built into one the kernels cannot
        step (``amsgrad=True`` loaded from a checkpoint, set by hand): ``fused=True``
        refuses the step in one line; ``fused=None`` takes the unfused step from here on,
        with one warning. The groups are the same on every rank, so every rank does the
        same, before anything moves."""
        reason = unsupported_reason(self.optimizer)
        if reason is None:
            return
        name = type(self.optimizer).__name__
        if self._fused_requested:
            raise RuntimeError(f"fused=True cannot step this {name} any more: {reason} (set in its param groups since "
                               "it was built, or loaded from a state_dict); pass fused=None to take the unfused step "
                               "where the fused one cannot")
        if is_main_process():
            logger.warning("%s now has %s, which mpfp16's fused step cannot step: every rank takes the unfused step "
                           "(the inner optimizer's own) from here on", name, reason)
        self._fused = None

    def _build(self, fp32_grads: bool, with_norm: bool, group, agree: bool) -> None:
        """Before a step that needs kernels not built yet (the first step; the first that
        reads unscale_()'s fp32 gradients or sums the squares for the norm; the first
        after a hyper-parameter changed a kernel's flags): build them, and make every rank
        take the same path.

        The outcome is gathered across ``group`` before anything is written. If any rank
        failed, ``fused=True`` raises on every rank, naming the ranks and the reason;
        ``fused=None`` moves every rank to the unfused step, with one warning.
        ``agree``: whether to ask the other ranks (not when this rank steps alone).
        Errors other than compile errors are not caught."""
        missing = {key: build for key, build in self._fused.variants(fp32_grads, with_norm).items()
                   if key not in self._ready}
        if not missing:
            return
        error = None
        started = time.perf_counter()
        if is_main_process():  # the first step waits for this: say why, once per kernel set
            logger.info("fused step: compiling its kernels%s (they are kept on disk, so a later run starts sooner)",
                        " for unscale_()'s fp32 gradients" if fp32_grads else "")
        try:
            for build in missing.values():
                build()
        except compile_errors() as exc:  # evaluated only when a build raised
            error = f"{type(exc).__name__}: {one_line(exc)}"
        found = failures(error, group=group) if agree else ({0: error} if error is not None else {})
        if not found:
            if is_main_process():
                logger.info("fused step: kernels ready in %.1f s", time.perf_counter() - started)
            self._ready |= missing.keys()
            return
        where = ", ".join(f"rank {rank}" for rank in found)
        reason = next(iter(found.values()))
        if self._fused_requested:
            raise FusedStepUnavailable(f"fused=True cannot be honoured: compiling the fused step failed on {where} "
                                       f"({reason})")
        if is_main_process():
            logger.warning("fused optimizer step unavailable: compiling failed on %s (%s); every rank uses the "
                           "unfused step", where, reason)
        self._fused = None

    # ---------------------------------------------------------------- the phases

    def zero(self, set_to_none: bool) -> None:
        for g in self.groups:
            g.zero_grads(set_to_none)
            g.release()

    def accumulate(self, first: bool) -> None:
        for g in self.groups:
            if g.accumulating:
                if first:
                    g.open_sum()
                g.accumulate()

    def unscale(self, scale: float, *, materialize: bool, with_norm: bool) -> Checked:
        if self._fused is not None:
            return self._fused.unscale(scale, materialize, with_norm)
        for g in self.groups:
            g.ready_fp32_grads()
        return Checked(unscale_and_check([t for g in self.groups for t in g.fp32_grads()], scale), materialized=True)

    def overflow(self, checked: Checked | None, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """Of the gradients the step read: a 16-bit group's fp32 ones where the step
        copied them there (the unfused step; the fused one after ``unscale_()``) or sums
        them there (fp32 accumulation), else the model's own."""
        fp32 = not before_unscale and checked is not None and checked.materialized
        position = {id(p): i for i, p in enumerate(self.params)}
        return find_nonfinite(((position[id(p)], grad) for g in self.groups for p, grad in
                               zip(g.params, g.grads_read(fp32 or g.accumulating))), limit)

    def norm(self, checked: Checked) -> torch.Tensor:
        if checked.grad_sumsq is not None:
            return self._fused.norm(checked)
        return total_norm([m.grad for m, p in zip(self.stepped, self.params) if p.requires_grad])

    def update(self, checked: Checked, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        self._noise = [torch.rand(g.layout.total, generator=rng, device=g.device)
                       if self.rounding == "stochastic" and g.half else None for g in self.groups]
        if self._fused is not None:
            self._fused.update(checked, scale, clip_coef, self._noise, rng)
            self._pending = "fused"
            return
        self._pending = "unfused"
        settle(self.optimizer, self.stepped, self.params, self.state_dtypes)
        if clip_coef is not None:  # what clip_grads_with_norm_ does, one multiply per buffer
            for g in self.groups:
                torch._foreach_mul_(g.fp32_grads(), clip_coef.to(g.device))
        for g in self.groups:
            if g.transient:
                g.master_from_weights()
        if self._keeper is not None:  # 16-bit states: widened a bounded chunk at a time
            self._keeper.step(self.stepped, [p.requires_grad for p in self.params], rng)
            return
        with HiddenGradients(m for m, p in zip(self.stepped, self.params) if not p.requires_grad):  # frozen now
            self.optimizer.step()

    @torch.no_grad()
    def copy_back(self) -> None:
        """Round the fp32 masters into the 16-bit model, one copy per buffer (without
        master weights, after an unfused update, with the chosen rounding); after a fused
        update, nothing: the kernels wrote them. Outside a step: the masters as they are."""
        pending, self._pending = self._pending, None
        for g, noise in zip(self.groups, self._noise):
            if g.half and pending != "fused":
                if g.has_master:
                    g.copy_back()
                elif pending == "unfused":
                    g.write_rounded(noise, self.rounding)
            if pending is not None:
                g.release()
        self._noise = [None] * len(self.groups)

    # ---------------------------------------------------------------- memory and state

    def memory(self) -> dict[str, float]:
        numel = max(1, sum(g.layout.numel for g in self.groups))
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

    def state_out(self) -> list[dict]:
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
            comps = g.layout.views(g.comp) if g.comp is not None else [None] * len(g.params)
            for p, m, c in zip(g.params, masters, comps):
                entries[position[id(p)]]["master"] = m
                if c is not None:
                    entries[position[id(p)]]["compensation"] = c
        return entries

    def _check_compensation(self, entries: list[dict], legacy: dict) -> None:
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

    @torch.no_grad()
    def state_in(self, entries: list[dict], legacy: dict, load_inner) -> None:
        """The inner optimizer's state (whole, on each parameter's device), adopted by
        the fused step at once (16-bit states held in 16 bits from the load on) or kept
        in the states' dtypes; then the saved masters (the model's own weights where
        none were saved), and the 16-bit weights set from them, so the two always agree;
        with remainders, the weights and remainders that hold the saved masters exactly."""
        self._check_compensation(entries, legacy)
        load_inner(lambda index, t: whole(t).to(self.stepped[index].device))
        if self._fused is not None:
            self._fused.reload(self.stepped, self.params, self.labels)
        elif self._keeper is not None:
            self._keeper.keep(self.stepped)
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
