"""Segments: runs of consecutive parameters of a flat buffer that share a key (their
param group, and whatever else a step splits on), one kernel call each."""

from __future__ import annotations

from .. import flat_buffers

__all__ = ["Segment", "runs"]


class Segment:
    """Consecutive parameters ``indices`` of a group that share a key (their param
    group, and whatever else the caller splits on), elements ``start`` to ``end`` of
    its buffers (alignment gaps included): one fused kernel call each."""

    __slots__ = ("key", "start", "end", "indices")

    def __init__(self, key, start: int, end: int, indices: tuple[int, ...]) -> None:
        self.key, self.start, self.end, self.indices = key, start, end, indices

    @property
    def group_index(self) -> int:
        return self.key[0]

    @property
    def range(self) -> slice:
        return slice(self.start, self.end)


def runs(keys: list, layout: flat_buffers.FlatLayout) -> list[Segment]:
    """The maximal runs of equal ``keys`` (one per parameter, in buffer order)."""
    segments, first, offsets = [], 0, layout.offsets
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[first]:
            end = offsets[i] if i < len(keys) else layout.total
            segments.append(Segment(keys[first], offsets[first], end, tuple(range(first, i))))
            first = i
    return segments
