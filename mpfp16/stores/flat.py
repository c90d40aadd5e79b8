"""The flat store and the per-tensor store: the parameters of one process, with fp32
masters in flat buffers.

A group is the parameters of one flat buffer (mpfp16/flat.py), or, for parameters
that can no longer move into one, of one (device, dtype, requires_grad):

:class:`FlatGroup`
    the model's own storage is the flat buffer: every parameter is a view of
    ``weights`` and its ``.grad`` a view of ``grads`` (16-bit, or fp32 for
    normalization layers), so a copy, an unscale or a round back is one op per buffer.
:class:`PerTensorGroup`
    the model's 16-bit parameters stay where they are (a ``.half()`` model already
    held by DDP, whose gradient hooks must not be cut off); their gradients are
    wherever autograd or DDP put them. Only the masters, which are the optimizer's
    own, are in a flat buffer.

Both give the inner optimizer the same fp32 masters, views of ``master`` with the
same layout, and copy between the model and the masters with foreach ops over
*parts*: the one flat buffer of a :class:`FlatGroup`, one tensor per parameter of a
:class:`PerTensorGroup`. Every operation is elementwise, so the two give the same
numbers bit for bit.

The stores: :class:`FlatStore` (every group flat; the unfused step, or the fused
kernels of mpfp16/stores/fused.py) and :class:`PerTensorStore` (some groups per
tensor; the unfused step).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import flat
from ..convert import HALF_DTYPES
from ..parallel import accumulation
from ..parallel.accumulation import SumOwner
from ..rounding import join_remainder, split_remainder, write_weights
from .base import ParamStore, find_nonfinite, storage_bytes, total_norm, unscale_and_check
from .segments import runs

__all__ = ["FlatGroup", "PerTensorGroup", "FlatStore", "PerTensorStore", "is_master", "build_local_store"]

logger = logging.getLogger("mpfp16")

_MASTER_ROLE = "mpfp16 masters"


def is_master(t: torch.Tensor) -> bool:
    """True for an fp32 master made by an FP16Optimizer (a view of its master buffer)."""
    return getattr(t._base, "_mpfp16_role", None) == _MASTER_ROLE


class FlatGroup:
    """The parameters of one flat buffer, their gradients and their fp32 masters.

    Attributes:
        params: the parameters, in buffer order.
        weights, grads: the model's flat buffers (parameters and their ``.grad``).
        master, master_grads, master_views: fp32 buffers of the same layout and the
            per-parameter views the inner optimizer steps; for an fp32 group the
            parameters themselves. ``master_grads`` gets memory, and the masters
            their ``.grad``, when a step first needs fp32 gradients (the fused step
            reads the 16-bit ones unless ``unscale_()`` was called). Without master
            weights (``transient``) the fp32 buffers have memory only inside a step.
        segments: runs of parameters of one param group.
        comp: Kahan rounding's 16-bit compensation buffer, or None.
        remainder: with ``master_weights="remainder"`` (a bf16 group), the int16
            remainders that with the bf16 weights hold the fp32 masters exactly
            (mpfp16.rounding.split_remainder), else None. Such a group is
            ``transient``: the fp32 masters are rebuilt from the two inside a step,
            and split again into them after it.
    """

    per_tensor = False
    accumulating = False  # the store sums this group's 16-bit gradients in fp32 (master_grads)

    def __init__(self, placed: flat.FlatParams, master_weights: bool | str, group_of: dict[int, int],
                 kahan: bool = False) -> None:
        self._setup(placed.params, placed.layout, master_weights, group_of, kahan)
        self.weights = placed.data
        self.grads = self.layout.empty(self.dtype, self.device)
        self.grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for p, g in zip(self.params, self.grad_views):
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g  # unlike moving the parameter, harmless under DDP
        self._grad_ptrs = [g.data_ptr() for g in self.grad_views]
        self._make_masters(master_weights)

    def _setup(self, params, layout, master_weights, group_of, kahan) -> None:
        self.params = list(params)
        self.layout = layout
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.half = self.dtype in HALF_DTYPES
        self.transient = self.half and (not master_weights or master_weights == "remainder")
        self.segments = runs([(group_of[id(p)],) for p in self.params], layout)
        self.comp = layout.empty(self.dtype, self.device) if kahan and self.half else None
        # Zero: a bf16 weight is an fp32 value whose lower 16 bits are zero.
        self.remainder = (layout.empty(torch.int16, self.device) if master_weights == "remainder" and self.half
                          else None)
        self._data_ptrs = [p.data_ptr() for p in self.params]
        # The step writes the weights through the flat buffer (or the parameters'
        # own storage), which leaves each parameter's own version counter alone; a
        # write from outside (DDP's initial broadcast from rank 0,
        # model.load_state_dict, an in-place init) bumps it, and the next step
        # re-reads that weight's master (check_params).
        self.mark_synced()

    def _make_masters(self, master_weights: bool) -> None:
        if not self.half:
            self.master, self.master_grads = self.weights, self.grads
            self.master_views = self.params
            return
        self.master = self.layout.empty(torch.float32, self.device)
        self.master._mpfp16_role = _MASTER_ROLE
        self.master_views = self.layout.views(self.master)
        with torch.no_grad():
            torch._foreach_copy_(self.parts(self.master), self.weight_parts())
        self.master_grads = self.layout.empty(torch.float32, self.device)
        flat.release(self.master_grads)  # the masters get their .grad when a step first needs it
        if self.transient:
            self._detach_masters()

    # --------------------------------------------------------------- the model's side

    def parts(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (of this group's layout) cut as the model's tensors are: whole."""
        return [buffer]

    def weight_parts(self) -> list[torch.Tensor]:
        return [self.weights]

    def grad_parts(self) -> list[torch.Tensor]:
        return [self.grads]

    def zero_grads(self, set_to_none: bool) -> None:
        """Zero the gradients in place, one fill per buffer: they are views of it."""
        self.grads.zero_()

    def check_params(self) -> None:
        """Raise if a parameter or its gradient left the flat buffers; re-read the
        master (and reset the Kahan compensation) of a weight written from outside
        since the last step; re-attach gradients that were replaced
        (``model.zero_grad()`` sets them to None, and the next backward then makes a
        fresh tensor)."""
        self._check_storage()
        self._resync()
        self._reattach_grads()

    def _reattach_grads(self) -> None:
        """Make every ``.grad`` the view of the buffer again, with the value of the
        gradient that replaced it (zero where it was set to None)."""
        for p, g in zip(self.params, self.grad_views):
            if p.grad is g:
                continue
            if p.grad is None:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g

    def _check_storage(self) -> None:
        for i, p in enumerate(self.params):
            if p.data_ptr() != self._data_ptrs[i] or (not self.per_tensor and
                                                       self.grad_views[i].data_ptr() != self._grad_ptrs[i]):
                where = "its place" if self.per_tensor else "the FP16Optimizer's flat buffer"
                raise RuntimeError(
                    f"a {self.dtype} parameter of shape {list(p.shape)} no longer lives in {where}: the model was "
                    "converted or moved (.half(), .to()) after the optimizer was built. Convert and move the model "
                    "first."
                )

    def _resync(self) -> None:
        for i, p in enumerate(self.params):
            if p._version != self._versions[i]:
                self._versions[i] = p._version
                if self.has_master:
                    self.master_views[i].copy_(p)
                if self.comp is not None:
                    self.layout.views(self.comp)[i].zero_()
                if self.remainder is not None:  # the master is the new bf16 weight, exactly
                    self.layout.views(self.remainder)[i].zero_()

    def model_grads(self) -> list[torch.Tensor]:
        """The model's gradient storage, for memory accounting."""
        return [self.grads]

    def grads_read(self, fp32: bool) -> list[torch.Tensor | None]:
        """Per parameter, in buffer order, the gradient a step reads: with ``fp32``, a
        16-bit group's view of its fp32 gradients (where the step copied them, or
        sums them under fp32 accumulation); else the model's own ``.grad``."""
        if fp32 and self.half and self.master_grads.untyped_storage().nbytes():
            return self.layout.views(self.master_grads)
        return [p.grad for p in self.params]

    # --------------------------------------------------------------- the masters' side

    # A view of a buffer whose memory was released must never be read: it would read
    # freed memory. So a released buffer's views are detached first: a master then
    # holds an empty tensor, and has no .grad, until the buffer has memory again.

    def _detach_masters(self) -> None:
        empty = torch.empty(0, device=self.device)
        with torch.no_grad():
            for m in self.master_views:
                m.grad = None
                m.set_(empty)
        flat.release(self.master)
        flat.release(self.master_grads)

    def _attach_masters(self) -> None:
        """Give the fp32 masters (without master weights, between steps they have none)
        their memory and their place in the buffer again."""
        if self.master.untyped_storage().nbytes() == 0:
            flat.restore(self.master)
            for m, view in zip(self.master_views, self.layout.views(self.master)):
                flat.repoint(m, view)

    @property
    def has_master(self) -> bool:
        """A 16-bit group with persistent fp32 masters."""
        return self.half and not self.transient

    def prepare_master_grads(self) -> None:
        """Give the fp32 gradient buffer memory and make its views the masters' ``.grad``
        (a no-op once done)."""
        if not self.half:
            return
        self._attach_masters()
        self._restore_master_grads()
        if self.master_views and self.master_views[0].grad is None:
            for m, g in zip(self.master_views, self.layout.views(self.master_grads)):
                m.grad = g

    def _restore_master_grads(self) -> None:
        if self.master_grads.untyped_storage().nbytes() == 0:
            flat.restore(self.master_grads)
            if self.per_tensor:  # copies fill the views only: the alignment gaps must read zero, not old memory
                self.master_grads.zero_()

    # fp32 accumulation (accumulate_dtype=torch.float32): the fp32 gradient buffer holds
    # the sum of the step's micro-batches, still scaled; the 16-bit gradients are
    # zeroed after each backward, so that autograd's next addition into them is exact.

    def sum_views(self) -> list[torch.Tensor]:
        """Per parameter, its view of the fp32 gradient sum (views stay valid objects
        while the buffer is released between steps; they are read only while it is not)."""
        released = self.master_grads.untyped_storage().nbytes() == 0
        self._restore_master_grads()
        views = self.layout.views(self.master_grads)
        if released:
            flat.release(self.master_grads)
        return views

    def open_sum(self) -> None:
        """The first backward of a step: the fp32 sum starts at zero."""
        self._restore_master_grads()
        self.master_grads.zero_()

    def accumulate(self) -> None:
        """After a backward: the fresh 16-bit gradients into the fp32 sum, and zeroed.
        A gradient that is no longer a view of the buffer (``model.zero_grad()`` set it
        to None, and autograd made a new one) is put back in it first, so it is added too."""
        self._reattach_grads()
        accumulation.add_widened(self.master_grads, self.grads)
        self.grads.zero_()

    def grads_to_master(self) -> None:
        """16-bit gradients into the fp32 master gradients, exactly (a 16-bit value is an
        fp32 value)."""
        self.prepare_master_grads()
        torch._foreach_copy_(self.parts(self.master_grads), self.grad_parts())

    def fp32_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the inner optimizer reads, as few tensors as the layout
        allows (after :meth:`grads_to_master` for a 16-bit group)."""
        return [self.master_grads] if self.half else self.grad_parts()

    def master_from_weights(self) -> None:
        """Without master weights: the fp32 values the step starts from (with
        remainders, the exact masters rebuilt from the weights and the remainders)."""
        self._attach_masters()
        if self.remainder is None:
            torch._foreach_copy_(self.parts(self.master), self.weight_parts())
            return
        for master, weights, remainder in zip(self.parts(self.master), self.weight_parts(),
                                              self.parts(self.remainder)):
            join_remainder(weights, remainder, out=master)

    def rebuilt_masters(self) -> list[torch.Tensor]:
        """With remainders: per parameter, its fp32 master rebuilt (a new tensor)."""
        return [join_remainder(p.detach(), r) for p, r in zip(self.params, self.layout.views(self.remainder))]

    def split_into_weights(self, masters: list[torch.Tensor | None]) -> None:
        """With remainders: set each parameter's bf16 weight and remainder from an fp32
        master (None: the weight as it is, remainder 0)."""
        for p, r, m in zip(self.params, self.layout.views(self.remainder), masters):
            if m is None:
                r.zero_()
            else:
                weight, remainder = split_remainder(m.to(device=r.device, dtype=torch.float32))
                p.copy_(weight)
                r.copy_(remainder)

    def copy_back(self) -> None:
        """Round the fp32 masters into the 16-bit weights, to nearest."""
        torch._foreach_copy_(self.weight_parts(), self.parts(self.master))

    def write_rounded(self, noise: torch.Tensor | None, rounding: str) -> None:
        """Without master weights: round the stepped fp32 values into the 16-bit
        weights as ``rounding`` says (mpfp16/rounding.py)."""
        noises = self.parts(noise) if noise is not None else [None] * len(self.weight_parts())
        comps = self.parts(self.comp) if self.comp is not None else [None] * len(noises)
        if self.remainder is not None:
            rounding, comps = "remainder", self.parts(self.remainder)
        for weights, new, n, c in zip(self.weight_parts(), self.parts(self.master), noises, comps):
            write_weights(weights, new, None if rounding == "remainder" else weights.float(), n, c, rounding)

    def release(self) -> None:
        """Free the fp32 buffers of a group without master weights."""
        if self.transient:
            self._detach_masters()

    def mark_synced(self) -> None:
        """The masters and the weights agree now: remember each weight's version."""
        self._versions = [p._version for p in self.params]


class PerTensorGroup(FlatGroup):
    """Parameters of one (device, dtype, requires_grad) that stay where they are: only
    their masters are in a flat buffer (module docstring). Their gradients are where
    autograd (or DDP) put them; ``zero_grad`` honours ``set_to_none``."""

    per_tensor = True

    def __init__(self, params: list[torch.Tensor], master_weights: bool | str, group_of: dict[int, int],
                 kahan: bool = False) -> None:
        self._setup(params, flat.FlatLayout.of(params), master_weights, group_of, kahan)
        self.weights = self.grads = None
        if self.half:
            self._make_masters(master_weights)
        else:  # fp32 parameters are stepped as they are, with their own gradients
            self.master = self.master_grads = None
            self.master_views = self.params

    def parts(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return self.layout.views(buffer)

    def weight_parts(self) -> list[torch.Tensor]:
        return self.params

    def grad_parts(self) -> list[torch.Tensor]:
        """One gradient per parameter; a parameter that requires grad and got none gets
        a zero one, so that it is stepped as a flat group steps it."""
        for p in self.params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params if p.grad is not None]

    def accumulate(self) -> None:
        have = [(s, p.grad) for s, p in zip(self.parts(self.master_grads), self.params) if p.grad is not None]
        for total, grad in have:
            accumulation.add_widened(total, grad)
        if have:
            torch._foreach_zero_([g for _, g in have])

    def grads_to_master(self) -> None:
        self.prepare_master_grads()
        views = self.parts(self.master_grads)
        have = [(v, p.grad) for v, p in zip(views, self.params) if p.grad is not None]
        if have:
            torch._foreach_copy_([v for v, _ in have], [g for _, g in have])
        missing = [v for v, p in zip(views, self.params) if p.grad is None]
        if missing:
            torch._foreach_zero_(missing)

    def zero_grads(self, set_to_none: bool) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if set_to_none:
            for p in self.params:
                p.grad = None
        elif grads:
            torch._foreach_zero_(grads)

    def check_params(self) -> None:
        """Raise if a parameter was moved; re-read the master of a weight written from
        outside since the last step."""
        self._check_storage()
        self._resync()

    def model_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    # The step writes through the parameters themselves, which bumps their version
    # counters: what the step wrote is remembered as synced, so that only writes from
    # outside make check_params re-read a master.

    def copy_back(self) -> None:
        super().copy_back()
        self.mark_synced()

    def write_rounded(self, noise: torch.Tensor | None, rounding: str) -> None:
        super().write_rounded(noise, rounding)
        self.mark_synced()


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


class FlatStore(ParamStore, SumOwner):
    """Every parameter in a flat buffer (module docstring). The step is the inner
    optimizer's own ``step()`` over the masters, or, after :meth:`use_fused`,
    mpfp16's fused kernels (mpfp16/stores/fused.py).

    Args:
        optimizer: the inner optimizer.
        params: every parameter it holds, in its order.
        groups: the groups those parameters were placed in (:func:`build_local_store`).
        rounding: without master weights, how new weights are rounded to 16 bits.
        accumulate: sum the 16-bit gradients of a step's micro-batches in fp32 (the
            fp32 gradient buffers, registered with :mod:`mpfp16.parallel.accumulation`
            so that mpfp16's DDP hooks carry the sum).
    """

    kind = "flat"

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], groups: list[FlatGroup],
                 rounding: str, accumulate: bool = False) -> None:
        super().__init__()
        self.optimizer, self.groups, self.rounding = optimizer, groups, rounding
        self.accumulates = accumulate and any(g.half for g in groups)
        for g in groups:
            g.accumulating = accumulate and g.half
            if g.accumulating:
                accumulation.register(g.params, g.sum_views(), self)
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

    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    def explain(self) -> str:
        n = len(self.groups)
        return f"flat store: {len(self.params)} parameters in {n} flat buffer{'s' * (n != 1)}"

    def fused_unsupported(self) -> str | None:
        return None

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def use_fused(self) -> None:
        from .fused import FusedStep

        self._fused = FusedStep(self.optimizer, self.groups, self.stepped, self.rounding)

    def use_unfused(self) -> None:
        self._fused = None

    def prepare(self, fp32_grads: bool, with_norm: bool = False) -> None:
        if self._fused is not None:
            self._fused.prepare(fp32_grads=fp32_grads, with_norm=with_norm)

    def invalidate(self) -> None:
        if self._fused is not None:
            self._fused.invalidate()

    # ---------------------------------------------------------------- the phases

    def check_ready(self) -> None:
        for g in self.groups:
            g.check_params()

    def zero_grad(self, set_to_none: bool) -> None:
        for g in self.groups:
            g.zero_grads(set_to_none)
        self.sum_open = False

    def open_sums(self) -> None:
        """Before a backward: the first of a step zeroes the fp32 sums."""
        if self.accumulates and not self.sum_open:
            for g in self.groups:
                if g.accumulating:
                    g.open_sum()
            self.sum_open, self.carried = True, False

    def accumulate(self) -> None:
        """After a backward (which :meth:`open_sums` preceded): the 16-bit gradients
        into the fp32 sums."""
        if not self.accumulates:
            return
        if not self.sum_open:  # without masters the sums have no memory before
            raise RuntimeError("accumulate() before open_sums(): the fp32 sums are not open")
        for g in self.groups:
            if g.accumulating:
                g.accumulate()

    def unscale(self, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        if self._fused is not None:
            return self._fused.unscale(scale, materialize, with_norm)
        for g in self.groups:
            if g.accumulating:
                g.prepare_master_grads()  # the sum is there already
            elif g.half:
                g.grads_to_master()
        return unscale_and_check([t for g in self.groups for t in g.fp32_grads()], scale)

    def nonfinite_grads(self, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """Of the gradients the step read: a 16-bit group's fp32 ones where the step
        copied them there (the unfused step; the fused one after ``unscale_()``) or sums
        them there (fp32 accumulation), else the model's own."""
        fp32 = not before_unscale and (self._fused is None or self._fused.from_master_grads)
        position = {id(p): i for i, p in enumerate(self.params)}
        return find_nonfinite(((position[id(p)], grad) for g in self.groups for p, grad in
                               zip(g.params, g.grads_read(fp32 or g.accumulating))), limit)

    def grad_norm(self) -> torch.Tensor:
        if self._fused is not None and not self._fused.from_master_grads:
            return self._fused.grad_norm()
        return total_norm([m.grad for m, p in zip(self.stepped, self.params) if p.requires_grad])

    def update(self, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        self._noise = [torch.rand(g.layout.total, generator=rng, device=g.device)
                       if self.rounding == "stochastic" and g.half else None for g in self.groups]
        if self._fused is not None:
            self._fused.update(clip_coef, self._noise)
            return
        if clip_coef is not None:  # what clip_grads_with_norm_ does, one multiply per buffer
            for g in self.groups:
                torch._foreach_mul_(g.fp32_grads(), clip_coef.to(g.device))
        for g in self.groups:
            if g.transient:
                g.master_from_weights()
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
        self.sum_open = False

    def skip(self) -> None:
        for g in self.groups:
            g.release()
        self.sum_open = False

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

    def state(self) -> dict:
        """The fp32 masters (with remainders: rebuilt, exactly, so that the state loads
        with fp32 masters too), None for those that are not kept."""
        masters = {id(m): m for g in self.groups if g.has_master for m in g.master_views}
        masters.update((id(m), rebuilt) for g in self.groups if g.remainder is not None
                       for m, rebuilt in zip(g.master_views, g.rebuilt_masters()))
        return {"master_params": [masters.get(id(m)) for m in self.stepped],
                "kahan_compensation": [g.comp for g in self.groups]}

    def check_state(self, state_dict: dict) -> None:
        saved_comp = state_dict.get("kahan_compensation", [None] * len(self.groups))
        for i, (g, comp) in enumerate(zip(self.groups, saved_comp)):
            if g.comp is not None and (comp is None or comp.shape != g.comp.shape):
                found = "none" if comp is None else f"{comp.numel()} elements"
                raise ValueError(f"Kahan compensation buffer {i} has {found} in the state_dict and "
                                 f"{g.comp.numel()} here")

    @torch.no_grad()
    def load_state(self, state_dict: dict) -> None:
        """The saved masters (rebuilt from the model's weights where none were saved),
        and the 16-bit weights set from them, so the two always agree; with
        remainders, the weights and remainders that hold the saved masters exactly."""
        saved_masters = state_dict["master_params"]
        position = {id(m): i for i, m in enumerate(self.stepped)}
        for g, comp in zip(self.groups, state_dict.get("kahan_compensation", [])):
            if g.comp is not None:
                g.comp.copy_(comp)
        for g in self.groups:
            if g.has_master:
                for p, m in zip(g.params, g.master_views):
                    saved = saved_masters[position[id(m)]] if id(m) in position else None
                    m.copy_(p if saved is None else saved)
                g.copy_back()
            elif g.remainder is not None:
                g.split_into_weights([saved_masters[position[id(m)]] if id(m) in position else None
                                      for m in g.master_views])
            g.mark_synced()  # the model was loaded first: its weights are not stale


class PerTensorStore(FlatStore):
    """Some parameters cannot move into a flat buffer any more (a ``.half()`` model
    that DDP already holds): those stay where they are, in per-tensor groups, and the
    rest are placed in flat buffers. The numbers are those of :class:`FlatStore`, bit
    for bit; the cost is a foreach copy over the tensors where a flat group makes one
    copy, and no fused step."""

    kind = "per-tensor"

    def __init__(self, optimizer, params, groups, rounding, why: str, accumulate: bool = False) -> None:
        super().__init__(optimizer, params, groups, rounding, accumulate)
        self.why = why

    def explain(self) -> str:
        stay = sum(len(g.params) for g in self.groups if g.per_tensor)
        return (f"per-tensor store: {stay} of {len(self.params)} parameters stay where they are, because "
                f"{self.why}; foreach ops over the tensors, the same numbers as flat buffers")

    def fused_unsupported(self) -> str | None:
        return "its parameters are not in flat buffers (they could no longer move: build FP16Optimizer before DDP)"


def build_local_store(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, master_weights: bool | str,
                      rounding: str, accumulate: bool = False) -> FlatStore:
    """Place ``params`` (every parameter ``optimizer`` holds, in its order) and return
    the store: a :class:`FlatStore` when every one is, or can be, in a flat buffer,
    else a :class:`PerTensorStore` in which those that cannot move stay where they are.
    Parameters of one (device, dtype) fill whole buffers: those that
    :func:`mpfp16.to_half` made are adopted as they are, the rest move into new ones."""
    group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    kahan = rounding == "kahan"
    groups: list[FlatGroup] = []
    why = None
    for ps in flat.by_key(params).values():
        try:
            placed = flat.place(ps)
        except flat.NotMovable as exc:
            why = "DistributedDataParallel (or another gradient hook) already holds them"
            logger.debug("%s", exc)
            groups += [PerTensorGroup(sub, master_weights, group_of, kahan)
                       for sub in flat.by_key(ps, frozen_apart=True).values()]
            continue
        groups += [FlatGroup(fp, master_weights, group_of, kahan) for fp in placed]
    if why is None:
        return FlatStore(optimizer, params, groups, rounding, accumulate)
    return PerTensorStore(optimizer, params, groups, rounding, why, accumulate)
