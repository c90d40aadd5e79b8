"""The roofline the step benchmarks divide by: the bandwidth this machine gives one pass
with an optimizer step's own streams, at the same thread count, in the same run.

A fused step reads and writes several buffers (streams) in one pass. mpfp16's AdamW
with masters reads the fp16 gradient, the fp32 master and both moments, and writes
those three and the fp16 weight: 8 streams, 28 bytes per parameter. A copy or a triad
over two or three fp32 streams does not bound such a kernel. On this project's CPU,
torch's own fused AdamW (7 streams) ran at 1.2-2.3x a torch-op copy, so "fraction of
the limit" came out above 1 and meant nothing.

So the limit is the best GB/s of these, each over buffers of the step's size, best of
``rounds`` calls:

- ``copy`` and ``triad``: torch ops over fp32 buffers (8 and 12 bytes per element);
- one compiled pass (``torch.compile``) per stream shape in :data:`SHAPES`, with the
  step's own buffers: the gradient, read only; the buffers the step updates in place
  (the master, the moments or the momentum, and the 16-bit weight where there is no
  master), read and written back; and the 16-bit weight where there is a master,
  written only. It averages what it reads in fp32 and writes that to every buffer
  written, in its dtype. This is the step's traffic with two operations per element,
  so there is no arithmetic for the memory time to hide behind. (Before 2026-12-02
  these passes wrote separate output buffers, which an ordinary store first reads: a
  traffic the in-place step does not have, so the passes ran at 0.5-0.8 of torch's
  fused AdamW and bounded nothing.);
- ``torch fused AdamW``: ``torch._fused_adamw_`` on one fp32 tensor (7 streams, 28
  bytes per parameter). Its GB/s is achievable by definition.

A kernel that does more arithmetic per byte than these can only be slower, so every
fraction of the limit is at most 1, up to timing noise. Each kernel's own GB/s is
reported beside the limit.
"""

from __future__ import annotations

import torch

from .timing import time_call

__all__ = ["SHAPES", "measure"]

F16, F32 = torch.float16, torch.float32
# name -> (dtypes read only, read and written in place, written only): the fused
# kernels' streams (mpfp16/stores/kernels.py, native.cpp)
SHAPES: dict[str, tuple[tuple[torch.dtype, ...], ...]] = {
    "sgd, masters (6 streams, 20 B)": ((F16,), (F32, F32), (F16,)),  # grad; master, momentum; weight
    "adam, masters (8 streams, 28 B)": ((F16,), (F32, F32, F32), (F16,)),  # grad; master, moments; weight
    "sgd, no masters (5 streams, 14 B)": ((F16,), (F16, F32), ()),  # grad; weight, momentum
    "adam, no masters (7 streams, 22 B)": ((F16,), (F16, F32, F32), ()),  # grad; weight, moments
}


def _one_pass(read: list[torch.Tensor], updated: list[torch.Tensor], written: list[torch.Tensor]) -> None:
    ins = [*read, *updated]
    total = ins[0].float()
    for r in ins[1:]:
        total = total + r.float()
    total = total * (1.0 / len(ins))  # an average: the values stay where they are, call after call
    for w in (*updated, *written):
        w.copy_(total)


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_one_pass, dynamic=False, fullgraph=True)
    return _compiled


def _best(fn, device: torch.device, rounds: int) -> float:
    fn()  # the first call touches the buffers (and compiles); not timed
    return min(time_call(fn, device) for _ in range(rounds))


def _bytes(dtypes) -> int:
    return sum(torch.empty((), dtype=d).element_size() for d in dtypes)


def measure(device: torch.device, numel: int, rounds: int = 5, shapes: dict | None = None,
            torch_adamw: bool = True) -> dict[str, float]:
    """GB/s of each roofline kernel over ``numel`` elements, best of ``rounds``: ``copy``,
    ``triad``, one compiled pass per stream shape of ``shapes`` (default
    :data:`SHAPES`; ``{}`` for none), and, with ``torch_adamw``, torch's fused AdamW.
    The limit is the largest value."""
    out = {}
    a = torch.zeros(numel, device=device)
    b = torch.rand(numel, device=device)
    c = torch.rand(numel, device=device)
    out["copy"] = 8 * numel / _best(lambda: a.copy_(b), device, rounds) / 1e9
    out["triad"] = 12 * numel / _best(lambda: torch.add(b, c, alpha=3.0, out=a), device, rounds) / 1e9
    del a, b, c
    for name, (read_only, in_place, write_only) in (SHAPES if shapes is None else shapes).items():
        read = [torch.rand(numel, device=device).to(d) for d in read_only]
        updated = [torch.rand(numel, device=device).to(d) for d in in_place]
        written = [torch.empty(numel, dtype=d, device=device) for d in write_only]
        seconds = _best(lambda: _kernel()(read, updated, written), device, rounds)
        out[name] = (_bytes(read_only) + 2 * _bytes(in_place) + _bytes(write_only)) * numel / seconds / 1e9
        del read, updated, written
    if not torch_adamw:
        return out
    p, g = torch.rand(numel, device=device), torch.rand(numel, device=device) * 1e-3
    m, v = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    steps = torch.zeros((), device=device)

    def adamw():
        torch._fused_adamw_([p], [g], [m], [v], [], [steps], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2,
                            eps=1e-8, amsgrad=False, maximize=False)

    out["torch fused AdamW (7 streams, 28 B)"] = 28 * numel / _best(adamw, device, rounds) / 1e9
    return out
