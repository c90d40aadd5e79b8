"""Flat buffers: many parameters re-pointed into one contiguous block of memory.

Every parameter of one (device, dtype) becomes a view of a single flat tensor, and so
does its gradient. The fp32 masters and their gradients use the same layout, so one
elementwise op over a flat buffer (copy, unscale, round back) treats every parameter
at once, with no Python loop over tensors.

Each parameter starts at a multiple of :data:`ALIGN` elements, so that every view
keeps the alignment that vectorized GPU kernels and cuBLAS want. The gaps are zero
and stay zero: their gradient is always zero, so no elementwise optimizer moves them.

A buffer is recognized from the parameters themselves, with nothing attached to them:
parameters that are views of one storage, laid out exactly as :class:`FlatLayout`
lays them out and filling it, are a flat buffer (:meth:`FlatParams.adopt`). So a
converted model pickles (``torch.save(model)`` keeps views of one storage as views of
one storage) and its loaded copy is adopted as it is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: 32 bytes of fp16, 64 bytes of fp32

__all__ = ["ALIGN", "FlatLayout", "FlatParams", "NotMovable", "is_dense", "place", "flatten_parameters",
           "check_movable", "by_key"]


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``t.numel()`` elements with no gap or overlap.

    Contiguous and channels_last tensors are dense; expanded or sliced ones are not.
    """
    expected = 1
    for dim in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(dim) == 1:
            continue
        if t.stride(dim) != expected:
            return False
        expected *= t.size(dim)
    return True


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a list lives inside one flat buffer.

    Views keep each tensor's own strides, so a channels_last weight stays
    channels_last.
    """

    shapes: tuple[torch.Size, ...]
    strides: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total: int  # elements in the buffer, gaps included

    @classmethod
    def of(cls, tensors: list[torch.Tensor], align: int = ALIGN) -> FlatLayout:
        offsets, offset = [], 0
        for t in tensors:
            if not is_dense(t):
                raise ValueError(
                    f"cannot flatten a parameter of shape {list(t.shape)} and strides "
                    f"{list(t.stride())}: it is not dense (expanded or sliced)"
                )
            offset = _round_up(offset, align)
            offsets.append(offset)
            offset += t.numel()
        return cls(
            shapes=tuple(t.shape for t in tensors),
            strides=tuple(tuple(t.stride()) for t in tensors),
            offsets=tuple(offsets),
            numels=tuple(t.numel() for t in tensors),
            total=_round_up(offset, align),
        )

    @property
    def numel(self) -> int:
        """Elements that belong to tensors (the gaps left out)."""
        return sum(self.numels)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per tensor, with the tensor's shape and strides."""
        if flat.numel() != self.total or not flat.is_contiguous():
            raise ValueError(f"expected a contiguous flat buffer of {self.total} elements")
        base = flat.storage_offset()
        return [
            flat.as_strided(shape, stride, base + offset)
            for shape, stride, offset in zip(self.shapes, self.strides, self.offsets)
        ]

    def empty(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer for this layout."""
        return torch.zeros(self.total, dtype=dtype, device=device)


def repoint(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``param`` (the same Python object, so every reference to it stays valid)
    use the storage of ``view``. The values must already have been copied there."""
    with torch.no_grad():
        param.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


def release(flat: torch.Tensor) -> None:
    """Free a flat buffer's memory; its views stay valid objects until :func:`restore`."""
    flat.untyped_storage().resize_(0)


def restore(flat: torch.Tensor) -> None:
    """Give a released flat buffer its memory back (uninitialized)."""
    storage = flat.untyped_storage()
    nbytes = flat.numel() * flat.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


# ------------------------------------------------------------ placing parameters
#
# A parameter is moved into a flat buffer once, before anything holds it. Moving it
# later is not safe: ``set_`` gives the parameter a new gradient accumulator, and
# DistributedDataParallel registered its allreduce hooks on the old one, so its
# gradients would silently stop being averaged. So :func:`mpfp16.to_half` places the
# parameters when it converts the model, FP16Optimizer adopts those buffers as they
# are, and whatever must still move is first checked by :func:`check_movable`.


class FlatParams:
    """Parameters of one device and dtype that are views of one flat buffer (``data``),
    in buffer order. Make one with :meth:`create` (which moves the parameters there)
    or find one with :meth:`adopt` (which moves nothing)."""

    def __init__(self, params: list[torch.Tensor], layout: FlatLayout, data: torch.Tensor) -> None:
        self.params, self.layout, self.data = params, layout, data

    @classmethod
    def create(cls, params: list[torch.Tensor]) -> FlatParams:
        """Move ``params`` (one device and dtype) into a new flat buffer, in this order.
        Each keeps its Python identity: every reference to it stays valid."""
        layout = FlatLayout.of(params)
        data = layout.empty(params[0].dtype, params[0].device)
        with torch.no_grad():
            for p, view in zip(params, layout.views(data)):
                view.copy_(p)
                repoint(p, view)
        return cls(list(params), layout, data)

    @classmethod
    def adopt(cls, params: list[torch.Tensor]) -> FlatParams | None:
        """The flat buffer that ``params`` (in any order) fill exactly, each at the
        place :class:`FlatLayout` gives it, or None: they are in several storages, or
        other tensors share theirs, or they were moved (``.to()``, ``.half()``)."""
        if not params:
            return None
        storage = params[0].untyped_storage()
        if any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in params):
            return None
        dtype, device = params[0].dtype, params[0].device
        if any(p.dtype != dtype for p in params):
            return None
        ordered = sorted(params, key=lambda p: p.storage_offset())
        try:
            layout = FlatLayout.of(ordered)
        except ValueError:
            return None
        base = ordered[0].storage_offset() - layout.offsets[0]
        if base != 0 or storage.nbytes() != layout.total * params[0].element_size():
            return None
        for p, offset, stride in zip(ordered, layout.offsets, layout.strides):
            if p.storage_offset() != offset or tuple(p.stride()) != stride:
                return None
        data = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (layout.total,))
        return cls(ordered, layout, data)


class NotMovable(RuntimeError):
    """Parameters would have to move after DDP (or another gradient hook) took hold of them."""


def _grad_accumulator_held(p: torch.Tensor) -> bool:
    """True when something other than this call keeps ``p``'s gradient accumulator
    alive: DistributedDataParallel's reducer does, to hook its allreduce on it.

    The accumulator is a node that autograd keeps only weakly; a mark left in its
    metadata survives dropping our reference only if another owner holds it.
    """
    if not p.requires_grad or not p.is_leaf:
        return False
    with torch.inference_mode(False), torch.enable_grad():
        node = p.view_as(p).grad_fn.next_functions[0][0]
        node.metadata["mpfp16.probe"] = True
        del node
        node = p.view_as(p).grad_fn.next_functions[0][0]
        return node.metadata.pop("mpfp16.probe", False)


def check_movable(params: list[torch.Tensor]) -> None:
    """Raise if moving or converting ``params`` would detach hooks that DDP holds.

    Raises:
        NotMovable: one line that names the fix.
    """
    held = [p for p in params if _grad_accumulator_held(p)]
    if held:
        raise NotMovable(
            f"{len(held)} parameters (the first of shape {list(held[0].shape)}, {held[0].dtype}) would have to "
            "move into a flat buffer after DistributedDataParallel (or another gradient hook) took hold of "
            "them, which silently stops DDP from averaging their gradients: call mpfp16.to_half(model) (for "
            "an fp32 model, mpfp16.flatten_parameters(model)) before wrapping it in DDP, or build "
            "FP16Optimizer before DDP"
        )


def place(params: list[torch.Tensor]) -> list[FlatParams]:
    """Put ``params`` (one device and dtype) in flat buffers and return them: the
    buffers that some of them fill exactly are adopted as they are, and the rest, after
    :func:`check_movable`, move into one new buffer, in the order given. A parameter
    alone in its storage moves too (a model never flattened), unless it is the only one.

    Raises:
        NotMovable: a parameter that is not in a buffer yet cannot move.
    """
    by_storage: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        by_storage[p.untyped_storage().data_ptr()].append(p)
    # A lone parameter can fill its own storage exactly, as a buffer of one would: it
    # counts as a buffer only when it is the only parameter of its device and dtype.
    placed, rest = [], []
    for ps in by_storage.values():
        found = FlatParams.adopt(ps) if len(ps) > 1 or len(params) == 1 else None
        if found is None:
            rest.extend(ps)
        else:
            placed.append(found)
    if rest:
        order = {id(p): i for i, p in enumerate(params)}
        rest.sort(key=lambda p: order[id(p)])
        check_movable(rest)
        placed.append(FlatParams.create(rest))
    return placed


def by_key(params, frozen_apart: bool = False) -> dict[tuple, list[torch.Tensor]]:
    """Parameters by (device, dtype), or with ``frozen_apart`` by (device, dtype,
    requires_grad), in the order given."""
    grouped: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        grouped[(p.device, p.dtype, p.requires_grad) if frozen_apart else (p.device, p.dtype)].append(p)
    return grouped


def flatten_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Place ``module``'s floating-point parameters in flat buffers, one per device,
    dtype and ``requires_grad``, in ``module.parameters()`` order; returns ``module``.

    :func:`mpfp16.to_half` calls it. Call it yourself for a model that stays fp32,
    before wrapping it in DistributedDataParallel, so that FP16Optimizer has nothing
    left to move whichever of the two is built first. Calling it again moves nothing.
    Frozen parameters get buffers of their own, so that an optimizer over the
    trainable ones alone, or over all of them, adopts the buffers as they are.
    """
    for params in by_key((p for p in module.parameters() if p.is_floating_point()), frozen_apart=True).values():
        place(params)
    return module
