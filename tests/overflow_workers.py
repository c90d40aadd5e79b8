"""Functions that run inside the 2-process gloo tests of ``opt.last_overflow``
(tests/test_distributed.py runs them in its worker group; tests/test_overflow.py
has the one-process cases)."""

from __future__ import annotations

import torch
import torch.nn as nn

import dist_workers as W
import mpfp16
import mpfp16.distributed as mdist

NAN, INF = float("nan"), float("inf")


def culprits_under_ddp(rank, store):
    """Four steps of W.mlp() (0: Linear(8, 32), 1: ReLU, 2: Linear(32, 4)) on two
    ranks, each rank's (stepped, last_overflow) after each:

    0. rank 1's first input is NaN: its loss is NaN, and the allreduce spreads the
       NaN gradients to rank 0;
    1. rank 1 alone writes a NaN into 0.weight's gradient after the allreduce (the
       flag reduction makes both skip; only rank 1's gradient holds it);
    2. rank 0 writes an inf into 2.bias's gradient, rank 1 two into 0.weight's;
    3. a clean step.

    ``store``: "flat" (mpfp16's wrap), "fused", or "per-tensor" (a ``.half()``
    model that torch's DDP holds before the optimizer is built)."""
    mdist.init(timeout_s=60)
    if store == "per-tensor":
        model = W.mlp().half()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model)
    else:
        model = mpfp16.to_half(W.mlp())
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                   fused=store == "fused")
        ddp = mdist.wrap(model)
    reports = []
    for step, (x, y) in enumerate(W.global_batches(4)):
        x, y = W.shard(x, rank, 2), W.shard(y, rank, 2)
        if step == 0 and rank == 1:
            x = x.clone()
            x[0, 0] = NAN
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(ddp(x.to(model[0].weight.dtype)).float(), y))
        with torch.no_grad():
            if step == 1 and rank == 1:
                model[0].weight.grad[0, 0] = NAN
            if step == 2:
                (model[2].bias.grad[1:2] if rank == 0 else model[0].weight.grad[3, :2]).fill_(INF)
        reports.append((opt.step(), opt.last_overflow))
    out = {"store": opt.store.kind, "fused": opt.fused, "reports": reports}
    mdist.teardown()
    return out
