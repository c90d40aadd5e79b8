"""The parameters of one process in groups: each group's fp32 masters in one flat
buffer, and the model's own tensors on one of two sides.

A :class:`ParamGroup` is the parameters of one flat buffer (mpfp16/flat_buffers.py), or, for
parameters that can no longer move into one, of one (device, dtype, requires_grad).
What the two kinds share, the masters' side, is the group's; where they differ, the
model's side, is one of two objects it holds:

:class:`FlatSide`
    the model's own storage is the flat buffer: every parameter is a view of
    ``weights`` and its ``.grad`` a view of ``grads`` (16-bit, or fp32 for
    normalization layers), so a copy, an unscale or a round back is one op per buffer.
:class:`TensorSide`
    the model's 16-bit parameters stay where they are (a ``.half()`` model already
    held by DDP, whose gradient hooks must not be cut off); their gradients are
    wherever autograd or DDP put them.

Both give the inner optimizer the same fp32 masters, views of ``master`` with the
same layout, and copy between the model and the masters with foreach ops over
*parts*: the one flat buffer of a flat side, one tensor per parameter of a tensor
side. Every operation is elementwise, so the two give the same numbers bit for bit.
"""

from __future__ import annotations

import torch

from .. import flat_buffers
from ..convert import HALF_DTYPES
from ..parallel import accumulation
from ..rounding import join_remainder, split_remainder, write_weights
from .segments import runs

__all__ = ["ParamGroup", "FlatSide", "TensorSide", "is_master", "KernelBuffers"]

_MASTER_ROLE = "mpfp16 masters"


def is_master(t: torch.Tensor) -> bool:
    """True for an fp32 master made by an FP16Optimizer (a view of its master buffer)."""
    return getattr(t._base, "_mpfp16_role", None) == _MASTER_ROLE


class FlatSide:
    """The model's tensors of a group in one flat buffer (module docstring)."""

    per_tensor = False

    def __init__(self, placed: flat_buffers.FlatParams, layout: flat_buffers.FlatLayout) -> None:
        self.params, self.layout = placed.params, layout
        self.weights = placed.data
        self.grads = layout.empty(self.weights.dtype, self.weights.device)
        self.grad_views = layout.views(self.grads)
        with torch.no_grad():
            for p, g in zip(self.params, self.grad_views):
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g  # unlike moving the parameter, harmless under DDP
        self._grad_ptrs = [g.data_ptr() for g in self.grad_views]

    def parts(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (of the group's layout) cut as the model's tensors are: whole."""
        return [buffer]

    def weight_parts(self) -> list[torch.Tensor]:
        return [self.weights]

    def grad_parts(self) -> list[torch.Tensor]:
        return [self.grads]

    def model_grads(self) -> list[torch.Tensor]:
        """The model's gradient storage, for memory accounting."""
        return [self.grads]

    def zero_grads(self, set_to_none: bool) -> None:
        """Zero the gradients in place, one fill per buffer: they are views of it."""
        self.grads.zero_()

    def moved(self, i: int) -> bool:
        """Whether parameter ``i``'s gradient left the flat buffer."""
        return self.grad_views[i].data_ptr() != self._grad_ptrs[i]

    def reattach_grads(self) -> None:
        """Make every ``.grad`` the view of the buffer again, with the value of the
        gradient that replaced it (zero where it was set to None): ``model.zero_grad()``
        sets them to None, and the next backward then makes a fresh tensor."""
        for p, g in zip(self.params, self.grad_views):
            if p.grad is g:
                continue
            if p.grad is None:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g

    def add_into(self, sums: torch.Tensor) -> None:
        """fp32 accumulation: the fresh 16-bit gradients into the fp32 sum (of the
        group's layout), and zeroed."""
        self.reattach_grads()
        accumulation.add_widened(sums, self.grads)
        self.grads.zero_()

    def copy_grads(self, out: torch.Tensor) -> None:
        """The 16-bit gradients into ``out`` (fp32, the group's layout), exactly."""
        torch._foreach_copy_([out], [self.grads])

    def wrote_weights(self, group: ParamGroup) -> None:
        """After the step wrote the weights: through the flat buffer, which leaves each
        parameter's own version counter alone."""


class TensorSide:
    """The model's tensors of a group where they are (module docstring). Their
    gradients are where autograd (or DDP) put them; ``zero_grad`` honours
    ``set_to_none``."""

    per_tensor = True
    weights = grads = None

    def __init__(self, params: list[torch.Tensor], layout: flat_buffers.FlatLayout) -> None:
        self.params, self.layout = list(params), layout

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

    def model_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grads(self, set_to_none: bool) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if set_to_none:
            for p in self.params:
                p.grad = None
        elif grads:
            torch._foreach_zero_(grads)

    def moved(self, i: int) -> bool:
        return False

    def reattach_grads(self) -> None:
        """The gradients are the parameters' own: nothing to reattach."""

    def add_into(self, sums: torch.Tensor) -> None:
        have = [(s, p.grad) for s, p in zip(self.parts(sums), self.params) if p.grad is not None]
        for total, grad in have:
            accumulation.add_widened(total, grad)
        if have:
            torch._foreach_zero_([g for _, g in have])

    def copy_grads(self, out: torch.Tensor) -> None:
        views = self.parts(out)
        have = [(v, p.grad) for v, p in zip(views, self.params) if p.grad is not None]
        if have:
            torch._foreach_copy_([v for v, _ in have], [g for _, g in have])
        missing = [v for v, p in zip(views, self.params) if p.grad is None]
        if missing:
            torch._foreach_zero_(missing)

    def wrote_weights(self, group: ParamGroup) -> None:
        """The step writes through the parameters themselves, which bumps their version
        counters: what it wrote is remembered as synced, so that only writes from
        outside make ``check_params`` re-read a master."""
        group.mark_synced()


class KernelBuffers:
    """What a fused kernel reads and writes for one run of a group's parameters
    (:meth:`ParamGroup.kernel_buffers`)."""

    __slots__ = ("weights", "grad", "master", "comp")

    def __init__(self, weights, grad, master, comp) -> None:
        self.weights, self.grad, self.master, self.comp = weights, grad, master, comp


class ParamGroup:
    """The parameters of one flat buffer (``side`` a :class:`FlatSide`) or of one
    (device, dtype, requires_grad) that stay where they are (a :class:`TensorSide`),
    their gradients and their fp32 masters.

    Attributes:
        params: the parameters, in buffer order.
        side: the model's tensors (module docstring).
        master, master_grads, master_views: fp32 buffers of the group's layout and the
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
        accumulating: the store sums this group's 16-bit gradients in fp32, in
            ``master_grads``.
    """

    def __init__(self, side: FlatSide | TensorSide, master_weights: bool | str, group_of: dict[int, int],
                 kahan: bool = False, accumulate: bool = False) -> None:
        self.side, self.params, self.layout = side, side.params, side.layout
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.half = self.dtype in HALF_DTYPES
        self.transient = self.half and (not master_weights or master_weights == "remainder")
        self.accumulating = accumulate and self.half
        self.param_groups = [group_of[id(p)] for p in self.params]  # each parameter's param group index
        self.segments = runs([(pg,) for pg in self.param_groups], self.layout)
        self.comp = self.layout.empty(self.dtype, self.device) if kahan and self.half else None
        # Zero: a bf16 weight is an fp32 value whose lower 16 bits are zero.
        self.remainder = (self.layout.empty(torch.int16, self.device) if master_weights == "remainder" and self.half
                          else None)
        self._data_ptrs = [p.data_ptr() for p in self.params]
        # The step writes the weights through the flat buffer (or the parameters'
        # own storage), which leaves each parameter's own version counter alone; a
        # write from outside (DDP's initial broadcast from rank 0,
        # model.load_state_dict, an in-place init) bumps it, and the next step
        # re-reads that weight's master (check_params).
        self.mark_synced()
        if self.half:
            self._make_masters()
        elif side.per_tensor:  # fp32 parameters are stepped as they are, with their own gradients
            self.master = self.master_grads = None
            self.master_views = self.params
        else:
            self.master, self.master_grads = side.weights, side.grads
            self.master_views = self.params

    @classmethod
    def flat(cls, placed: flat_buffers.FlatParams, master_weights, group_of, kahan=False,
             accumulate=False) -> ParamGroup:
        return cls(FlatSide(placed, placed.layout), master_weights, group_of, kahan, accumulate)

    @classmethod
    def per_tensor(cls, params, master_weights, group_of, kahan=False, accumulate=False) -> ParamGroup:
        return cls(TensorSide(params, flat_buffers.FlatLayout.of(params)), master_weights, group_of, kahan, accumulate)

    @property
    def weights(self) -> torch.Tensor | None:
        """The flat buffer of the weights (a flat side only)."""
        return self.side.weights

    @property
    def grads(self) -> torch.Tensor | None:
        return self.side.grads

    def _make_masters(self) -> None:
        self.master = self.layout.empty(torch.float32, self.device)
        self.master._mpfp16_role = _MASTER_ROLE
        self.master_views = self.layout.views(self.master)
        with torch.no_grad():
            torch._foreach_copy_(self.side.parts(self.master), self.side.weight_parts())
        self.master_grads = self.layout.empty(torch.float32, self.device)
        flat_buffers.release(self.master_grads)  # the masters get their .grad when a step first needs it
        if self.transient:
            self._detach_masters()

    # --------------------------------------------------------------- the model's side

    def zero_grads(self, set_to_none: bool) -> None:
        self.side.zero_grads(set_to_none)

    def model_grads(self) -> list[torch.Tensor]:
        return self.side.model_grads()

    def weight_parts(self) -> list[torch.Tensor]:
        return self.side.weight_parts()

    def check_params(self) -> None:
        """Raise if a parameter or its gradient left its storage; re-read the master
        (and reset the Kahan compensation) of a weight written from outside since the
        last step; re-attach gradients that were replaced."""
        for i, p in enumerate(self.params):
            if p.data_ptr() != self._data_ptrs[i] or self.side.moved(i):
                where = "its place" if self.side.per_tensor else "the FP16Optimizer's flat buffer"
                raise RuntimeError(
                    f"a {self.dtype} parameter of shape {list(p.shape)} no longer lives in {where}: the model was "
                    "converted or moved (.half(), .to()) after the optimizer was built. Convert and move the model "
                    "first."
                )
        self._resync()
        self.side.reattach_grads()

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

    def grads_read(self, fp32: bool) -> list[torch.Tensor | None]:
        """Per parameter, in buffer order, the gradient a step reads: with ``fp32``, a
        16-bit group's view of its fp32 gradients (where the step copied them, or
        sums them under fp32 accumulation); else the model's own ``.grad``."""
        if fp32 and self.half and self.master_grads.untyped_storage().nbytes():
            return self.layout.views(self.master_grads)
        return [p.grad for p in self.params]

    def check_grads(self, materialized: bool) -> torch.Tensor:
        """The flat gradient buffer a fused overflow check reads: the unscaled fp32
        gradients after ``unscale_()``, the scaled fp32 sum under fp32 accumulation,
        else the 16-bit gradients (fp32 ones for an fp32 group). A flat side only."""
        return self.master_grads if self.half and (materialized or self.accumulating) else self.side.grads

    def kernel_buffers(self, span: slice, materialized: bool) -> KernelBuffers:
        """The slices of ``span`` (a run of this flat group's buffer) that a fused
        kernel reads and writes: weights, gradient, master (None without persistent
        masters) and ``comp`` (Kahan's compensation, or the remainders)."""
        comp = self.remainder if self.remainder is not None else self.comp
        return KernelBuffers(self.side.weights[span], self.check_grads(materialized)[span],
                             self.master[span] if self.has_master else None,
                             comp[span] if comp is not None else None)

    def kernel_rounding(self, rounding: str) -> str:
        """How a fused kernel writes this group's weights: a bf16 group with remainders
        reads and writes its exact masters as weights and remainders."""
        if self.remainder is not None:
            return "remainder"
        return rounding if self.transient else "nearest"

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
        flat_buffers.release(self.master)
        flat_buffers.release(self.master_grads)

    def _attach_masters(self) -> None:
        """Give the fp32 masters (without master weights, between steps they have none)
        their memory and their place in the buffer again."""
        if self.master.untyped_storage().nbytes() == 0:
            flat_buffers.restore(self.master)
            for m, view in zip(self.master_views, self.layout.views(self.master)):
                flat_buffers.repoint(m, view)

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
            flat_buffers.restore(self.master_grads)
            if self.side.per_tensor:  # copies fill the views only: the alignment gaps must read zero, not old memory
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
            flat_buffers.release(self.master_grads)
        return views

    def open_sum(self) -> None:
        """The first backward of a step: the fp32 sum starts at zero."""
        self._restore_master_grads()
        self.master_grads.zero_()

    def accumulate(self) -> None:
        """After a backward: the fresh 16-bit gradients into the fp32 sum, and zeroed.
        A gradient that is no longer a view of the buffer (``model.zero_grad()`` set it
        to None, and autograd made a new one) is put back in it first, so it is added too."""
        self.side.add_into(self.master_grads)

    def grads_to_master(self) -> None:
        """16-bit gradients into the fp32 master gradients, exactly (a 16-bit value is an
        fp32 value)."""
        self.prepare_master_grads()
        self.side.copy_grads(self.master_grads)

    def fp32_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the inner optimizer reads, as few tensors as the layout
        allows (after :meth:`grads_to_master` for a 16-bit group)."""
        return [self.master_grads] if self.half else self.side.grad_parts()

    def ready_fp32_grads(self) -> None:
        """The step's fp32 gradients in place: the sum is there already under fp32
        accumulation; else the 16-bit gradients are copied there."""
        if self.accumulating:
            self.prepare_master_grads()
        elif self.half:
            self.grads_to_master()

    def master_from_weights(self) -> None:
        """Without master weights: the fp32 values the step starts from (with
        remainders, the exact masters rebuilt from the weights and the remainders)."""
        self._attach_masters()
        if self.remainder is None:
            torch._foreach_copy_(self.side.parts(self.master), self.side.weight_parts())
            return
        for master, weights, remainder in zip(self.side.parts(self.master), self.side.weight_parts(),
                                              self.side.parts(self.remainder)):
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
        torch._foreach_copy_(self.side.weight_parts(), self.side.parts(self.master))
        self.side.wrote_weights(self)

    def write_rounded(self, noise: torch.Tensor | None, rounding: str) -> None:
        """Without master weights: round the stepped fp32 values into the 16-bit
        weights as ``rounding`` says (mpfp16/rounding.py)."""
        parts = self.side.parts
        noises = parts(noise) if noise is not None else [None] * len(self.side.weight_parts())
        comps = parts(self.comp) if self.comp is not None else [None] * len(noises)
        if self.remainder is not None:
            rounding, comps = "remainder", parts(self.remainder)
        for weights, new, n, c in zip(self.side.weight_parts(), parts(self.master), noises, comps):
            write_weights(weights, new, None if rounding == "remainder" else weights.float(), n, c, rounding)
        self.side.wrote_weights(self)

    def release(self) -> None:
        """Free the fp32 buffers of a group without master weights."""
        if self.transient:
            self._detach_masters()

    def mark_synced(self) -> None:
        """The masters and the weights agree now: remember each weight's version."""
        self._versions = [p._version for p in self.params]
