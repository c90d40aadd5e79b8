"""Flat buffers: many parameters re-pointed into one contiguous block of memory.

Every parameter of one (device, dtype) becomes a view of a single flat tensor, and so
does its gradient. The fp32 masters and their gradients use the same layout, so one
elementwise op over a flat buffer (copy, unscale, round back) treats every parameter
at once, with no Python loop over tensors.

Each parameter starts at a multiple of :data:`ALIGN` elements, so that every view
keeps the alignment that vectorized GPU kernels and cuBLAS want. The gaps are zero
and stay zero: their gradient is always zero, so no elementwise optimizer moves them.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: 32 bytes of fp16, 64 bytes of fp32

__all__ = ["ALIGN", "FlatLayout", "FlatParams", "is_dense", "place", "flatten_parameters", "check_movable"]


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
    """Parameters of one device and dtype, moved into one flat buffer (``data``).

    Each parameter keeps its Python identity (every reference to it stays valid) and
    is tagged with the buffer it lives in, so that a later :func:`place` of the same
    parameters finds it and moves nothing. The buffer refers to its parameters only
    weakly: it never keeps a model alive.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.layout = FlatLayout.of(params)
        self.data = self.layout.empty(params[0].dtype, params[0].device)
        with torch.no_grad():
            for p, view in zip(params, self.layout.views(self.data)):
                view.copy_(p)
                repoint(p, view)
                p._mpfp16_flat = self
        self._params = [weakref.ref(p) for p in params]

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters in buffer order (None for one that no longer exists)."""
        return [ref() for ref in self._params]

    def _in_place(self, p: torch.Tensor, i: int) -> bool:
        return (p.untyped_storage().data_ptr() == self.data.untyped_storage().data_ptr()
                and p.storage_offset() == self.data.storage_offset() + self.layout.offsets[i]
                and p.shape == self.layout.shapes[i] and p.stride() == self.layout.strides[i])

    def holds_exactly(self, params: list[torch.Tensor]) -> bool:
        """True when ``params`` (in any order) are all of this buffer's parameters, each
        still at its place (not moved by ``.to()``, ``.half()`` and the like)."""
        mine = self.params
        if len(params) != len(mine) or {id(p) for p in params} != {id(p) for p in mine if p is not None}:
            return False
        return all(self._in_place(p, i) for i, p in enumerate(mine))


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
        RuntimeError: one line that names the fix.
    """
    held = [p for p in params if _grad_accumulator_held(p)]
    if held:
        raise RuntimeError(
            f"{len(held)} parameters (the first of shape {list(held[0].shape)}, {held[0].dtype}) would have to "
            "move into a flat buffer after DistributedDataParallel (or another gradient hook) took hold of "
            "them, which silently stops DDP from averaging their gradients: call mpfp16.to_half(model) (for "
            "an fp32 model, mpfp16.flatten_parameters(model)) before wrapping it in DDP, or build "
            "FP16Optimizer before DDP"
        )


def place(params: list[torch.Tensor]) -> FlatParams:
    """Put ``params`` (one device and dtype) in one flat buffer and return it: the
    buffer they already fill exactly, which moves nothing, or a new one, after
    :func:`check_movable`."""
    existing = getattr(params[0], "_mpfp16_flat", None)
    if isinstance(existing, FlatParams) and existing.holds_exactly(params):
        return existing
    check_movable(params)
    return FlatParams(params)


def trainable_by_key(params) -> dict[tuple, list[torch.Tensor]]:
    """Parameters that require grad, by (device, dtype), in the order given."""
    by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.requires_grad:
            by_key[(p.device, p.dtype)].append(p)
    return by_key


def flatten_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Place ``module``'s trainable parameters in flat buffers, one per device and
    dtype, in ``module.parameters()`` order; returns ``module``.

    :func:`mpfp16.to_half` calls it. Call it yourself for a model that stays fp32,
    before wrapping it in DistributedDataParallel, so that FP16Optimizer has nothing
    left to move whichever of the two is built first. Calling it again moves nothing.
    Frozen parameters (``requires_grad=False``) stay where they are.
    """
    for params in trainable_by_key(module.parameters()).values():
        place(params)
    return module
