"""Point-to-point exchange among the ranks of a group: what the ``fp32_accumulate``
wire and the 8-bit wires build their reduce-scatter and all-gather from."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["exchange"]


def exchange(group, rank: int, sends: list, recvs: list) -> None:
    """Send ``sends[j]`` to rank j and receive ``recvs[j]`` from it, for every rank j of
    ``group`` but ``rank``. Each entry is a tensor or a list of tensors (sent, and
    received, in that order); empty tensors are neither sent nor received (both sides
    know every size).

    Every receive is posted before any send. On gloo, with the sends first, the two
    directions of a link often ran one after the other: on an emulated 1 Gbit/s link
    (mpfp16.bench.netem) 8 MB each way took 118-140 ms in 8 of 12 tries, against
    70-81 ms in 12 of 12 with the receives first (67 ms is the link's limit)."""
    receives, sends_ = [], []
    for j, (s, r) in enumerate(zip(sends, recvs)):
        if j == rank:
            continue
        peer = dist.get_global_rank(group, j)
        for tensor in _listed(r):
            if tensor.numel():
                receives.append(dist.P2POp(dist.irecv, tensor, peer, group))
        for tensor in _listed(s):
            if tensor.numel():
                sends_.append(dist.P2POp(dist.isend, tensor, peer, group))
    ops = receives + sends_
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _listed(entry) -> list[torch.Tensor]:
    return [entry] if isinstance(entry, torch.Tensor) else list(entry)
