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

from dataclasses import dataclass

import torch

ALIGN = 16  # elements: 32 bytes of fp16, 64 bytes of fp32

__all__ = ["ALIGN", "FlatLayout", "is_dense"]


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
