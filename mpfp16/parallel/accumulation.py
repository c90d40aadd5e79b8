"""fp32 sums of micro-batch gradients, and the DDP exchange that carries them.

``FP16Optimizer(..., accumulate_dtype=torch.float32)`` keeps each 16-bit
parameter's gradient, summed over the micro-batches of one optimizer step, in an
fp32 buffer: after each ``opt.backward()`` the fresh 16-bit gradients are added into
it and zeroed. The optimizer registers its store's fp32 views here (:func:`register`),
by parameter, with the step guard that owns them.

Under data parallelism the step still makes one exchange, on the last micro-batch,
and it must carry the sum, not that micro-batch alone. mpfp16's communication hooks
(:mod:`mpfp16.parallel.hooks`) ask :func:`open_sums` for a bucket's parameters:

- 16-bit wire (``"allreduce"``, ``"fp32_accumulate"``): the bucket becomes the
  16-bit rounding of (fp32 sum + this micro-batch) (:meth:`Carry.fold`), and the hook
  averages it as usual;
- fp32 wire (``"allreduce"`` with ``allreduce_dtype=torch.float32``): the wire holds
  fp32 sum + micro-batch (:meth:`Carry.fold_into`), so nothing is rounded to 16 bits.

Either way the average lands in the sums themselves (:meth:`Carry.land`).

Any other exchange (a stock ``DistributedDataParallel``, an allreduce of ``.grad``
written by hand) would send the last micro-batch only: the hooks mark each sum they
carry (their owner's ``carried``), and the optimizer refuses a distributed step whose sums
no exchange carried.

The registry holds the parameters weakly and by identity (a tensor's ``==`` is
elementwise), so nothing here outlives the model.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["register", "open_sums", "Carry", "add_widened"]

WIDEN_CHUNK = 1 << 18  # elements widened at a time: 1 MiB of fp32, in cache


def add_widened(total: torch.Tensor, half: torch.Tensor) -> None:
    """``total += half``: an fp32 tensor plus a 16-bit one of its shape, the same
    numbers as torch's mixed-dtype ``add_`` (widening a 16-bit value is exact).
    On CPU that kernel runs at about a fifth of the memory bandwidth (ResNet-50's
    25.5M parameters: 90 ms against 12 ms this way, one thread), and widening the
    whole tensor first costs a transient fp32 copy; so a contiguous tensor is
    widened a chunk at a time."""
    if total.device.type != "cpu" or not (total.is_contiguous() and half.is_contiguous()):
        total.add_(half)
        return
    flat_total, flat_half = total.view(-1), half.view(-1)
    for start in range(0, flat_total.numel(), WIDEN_CHUNK):
        flat_total[start:start + WIDEN_CHUNK].add_(flat_half[start:start + WIDEN_CHUNK].float())


# parameter -> (its fp32 sum view, a weak reference to its owner): the owner holds the
# parameters, so a strong reference would keep every key alive.
_SUMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(sums: list[tuple[torch.Tensor, torch.Tensor]], owner) -> None:
    """Record each ``(parameter, fp32 sum of its shape)`` of ``sums``, owned by
    ``owner``: an object with ``sum_open`` (True from the first backward of an
    optimizer step until the step or ``zero_grad()`` consumes the sums; only open sums
    are carried) and a settable ``carried`` (an exchange carried some of them in this
    step). FP16Optimizer registers its sums with its step guard
    (:class:`mpfp16.step_state.StepGuard`), explicitly, when it is built."""
    ref = weakref.ref(owner)
    for p, s in sums:
        _SUMS[p] = (s, ref)


def open_sums(params: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
    """Per parameter, its open fp32 sum (None where it has none), each sum's owner
    marked as carried; None when no parameter of ``params`` has one (the usual case:
    one dictionary lookup). Only an exchange may call it: the sums it returns are
    sent."""
    if not _SUMS:
        return None
    found = []
    for p in params:
        entry = _SUMS.get(p)
        owner = entry[1]() if entry is not None else None
        if owner is not None and owner.sum_open:
            owner.carried = True
            found.append(entry[0])
        else:
            found.append(None)
    return found if any(s is not None for s in found) else None


class Carry:
    """The open sums of one bucket's parameters, from the hook's hand-over to its
    result (:meth:`of`). The exchange sends sum + this micro-batch; its average
    *lands* in the sums, and the bucket is zeroed, so that DDP copies zeros into
    ``.grad`` and the optimizer's post-backward addition leaves the sums as they are.
    Landing in the hook, not through ``.grad``, keeps a parameter that no rank used in
    the last micro-batch: DDP leaves such a gradient untouched
    (``find_unused_parameters``), and its sum would otherwise be lost."""

    def __init__(self, sums: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        self.sums, self.views = sums, views

    @classmethod
    def of(cls, bucket) -> Carry | None:
        """The bucket's open sums (each owner marked as carried), or None (at once,
        without reading the bucket, when no optimizer accumulates in fp32)."""
        if not _SUMS:
            return None
        sums = open_sums(bucket.parameters())
        if sums is None:
            return None
        pairs = [(s, g) for s, g in zip(sums, bucket.gradients()) if s is not None]  # views of the buffer
        return cls([s for s, _ in pairs], [g for _, g in pairs])

    @torch.no_grad()
    def fold(self) -> None:
        """16-bit wire: the bucket's views become the 16-bit rounding of sum + micro-batch."""
        for total, view in zip(self.sums, self.views):
            add_widened(total, view)  # exact widening, one fp32 rounding
        torch._foreach_copy_(self.views, self.sums)  # rounded once to 16 bits, to nearest

    @torch.no_grad()
    def fold_into(self, wire: torch.Tensor, buf: torch.Tensor) -> list[torch.Tensor]:
        """fp32 wire: ``wire`` (``buf`` upcast) gets each sum added where its view lies;
        returns those pieces of ``wire``."""
        pieces = [wire.as_strided(v.size(), v.stride(), v.storage_offset() - buf.storage_offset())
                  for v in self.views]
        torch._foreach_add_(pieces, self.sums)
        return pieces

    @torch.no_grad()
    def land(self, results: list[torch.Tensor] | None = None) -> None:
        """After the exchange: the sums take the average (``results``, the fp32 wire's
        pieces, or the bucket's 16-bit views, exactly widened), and the views are zeroed."""
        torch._foreach_copy_(self.sums, results if results is not None else self.views)
        torch._foreach_zero_(self.views)
