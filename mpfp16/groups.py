"""The trainable parameters of one device and dtype, with their gradients and fp32
masters in flat buffers: what both step backends work on (mpfp16/backends/).

A :class:`FlatGroup` is FP16Optimizer's view of a :class:`mpfp16.flat.FlatParams`:

``weights``, ``grads``
    the model's own storage: every parameter is a view of ``weights`` and its
    ``.grad`` a view of ``grads`` (16-bit, or fp32 for normalization layers).
``master``, ``master_grads``, ``master_views``
    fp32 buffers of the same layout and the per-parameter views the inner optimizer
    steps; for an fp32 group, ``weights``, ``grads`` and the parameters themselves.
    ``master_grads`` gets memory, and the masters their ``.grad``, when a backend first
    needs fp32 gradients (the fused step reads the 16-bit ones unless ``unscale_()``
    was called). Without master weights (``transient``) the fp32 buffers have memory
    only inside a step; between steps each master is an empty tensor.
``segments``
    contiguous ranges of parameters of one param group: one fused kernel call each.
``comp``
    Kahan rounding's 16-bit compensation buffer, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import flat
from .convert import HALF_DTYPES

__all__ = ["FlatGroup", "Segment", "is_master"]

_MASTER_ROLE = "mpfp16 masters"


@dataclass(frozen=True)
class Segment:
    """The parameters of one param group inside a flat buffer: elements ``start`` to
    ``end`` (alignment gaps included), parameters ``indices`` of the group."""

    group_index: int
    start: int
    end: int
    indices: tuple[int, ...]

    @property
    def range(self) -> slice:
        return slice(self.start, self.end)


def is_master(t: torch.Tensor) -> bool:
    """True for an fp32 master made by an FP16Optimizer (a view of its master buffer)."""
    return getattr(t._base, "_mpfp16_role", None) == _MASTER_ROLE


class FlatGroup:
    """Flat buffers for ``params`` (one device and dtype) and their masters.

    Args:
        params: the trainable parameters; placed by :func:`mpfp16.flat.place`, which
            moves nothing when :func:`mpfp16.to_half` already placed exactly these.
        master_weights: keep persistent fp32 masters of 16-bit parameters.
        group_of: ``id(param)`` -> index of its param group in the inner optimizer.
        kahan: keep a compensation buffer for Kahan rounding.
    """

    def __init__(self, params: list[torch.Tensor], master_weights: bool, group_of: dict[int, int],
                 kahan: bool = False) -> None:
        placed = flat.place(params)
        self.params = params = placed.params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.half = self.dtype in HALF_DTYPES
        self.layout = placed.layout
        self.weights = placed.data
        self.grads = self.layout.empty(self.dtype, self.device)
        self.grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for p, g in zip(params, self.grad_views):
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g  # unlike moving the parameter, harmless under DDP
        self._data_ptrs = [p.data_ptr() for p in params]
        self._grad_ptrs = [g.data_ptr() for g in self.grad_views]
        # The step writes the weights through the flat buffer, which leaves each
        # parameter's own version counter alone; a write through the parameter itself
        # (DDP's initial broadcast from rank 0, model.load_state_dict, an in-place init)
        # bumps it, and the next step re-reads that weight's master (check_params).
        self.mark_synced()
        self.segments = self._segments([group_of[id(p)] for p in params])
        self.comp = self.layout.empty(self.dtype, self.device) if kahan and self.half else None
        self.transient = self.half and not master_weights
        if not self.half:
            self.master, self.master_grads = self.weights, self.grads
            self.master_views = params
            return
        self.master = self.weights.float()
        self.master._mpfp16_role = _MASTER_ROLE
        self.master_grads = self.layout.empty(torch.float32, self.device)
        self.master_views = self.layout.views(self.master)
        flat.release(self.master_grads)  # the masters get their .grad when a backend first needs it
        if self.transient:
            self._detach_masters()

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

    def _segments(self, group_indices: list[int]) -> list[Segment]:
        """Consecutive runs of parameters of the same param group. The buffer is in
        model order, so a param group can make several runs (weights and biases in
        groups with and without weight decay, say)."""
        segments, first, offsets = [], 0, self.layout.offsets
        for i in range(1, len(group_indices) + 1):
            if i == len(group_indices) or group_indices[i] != group_indices[first]:
                end = offsets[i] if i < len(group_indices) else self.layout.total
                segments.append(Segment(group_indices[first], offsets[first], end, tuple(range(first, i))))
                first = i
        return segments

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
        if self.master_grads.untyped_storage().nbytes() == 0:
            flat.restore(self.master_grads)
            for m, g in zip(self.master_views, self.layout.views(self.master_grads)):
                m.grad = g

    def master_from_weights(self) -> None:
        """Without master weights: the fp32 values the step starts from."""
        if self.half:
            self._attach_masters()
            self.master.copy_(self.weights)

    def release(self) -> None:
        """Free the fp32 buffers of a group without master weights."""
        if self.transient:
            self._detach_masters()

    def mark_synced(self) -> None:
        """The masters and the weights agree now: remember each weight's version."""
        self._versions = [p._version for p in self.params]

    def check_params(self) -> None:
        """Raise if a parameter or its gradient left the flat buffers; re-read the
        master (and reset the Kahan compensation) of a weight written from outside
        since the last step; re-attach gradients that were replaced
        (``model.zero_grad()`` sets them to None, and the next backward then makes a
        fresh tensor)."""
        for i, (p, g) in enumerate(zip(self.params, self.grad_views)):
            if p.data_ptr() != self._data_ptrs[i] or g.data_ptr() != self._grad_ptrs[i]:
                raise RuntimeError(
                    f"a {self.dtype} parameter of shape {list(p.shape)} no longer lives in the "
                    "FP16Optimizer's flat buffer: the model was converted or moved (.half(), "
                    ".to()) after the optimizer was built. Convert and move the model first."
                )
            if p._version != self._versions[i]:
                self._versions[i] = p._version
                if self.has_master:
                    self.master_views[i].copy_(p)
                if self.comp is not None:
                    self.layout.views(self.comp)[i].zero_()
            if p.grad is g:
                continue
            if p.grad is None:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g
