"""Functions that run inside the 2-process gloo tests (tests/test_distributed.py)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist


def mlp(seed=0, norm=None):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 32)]
    if norm == "bn":
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def global_batches(steps, batch=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g) * 3, torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def shard(x, rank, world):
    return x.chunk(world)[rank]


def flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def train_dp(rank, steps, wrap_kw, accum=1, dtype="float16", master_weights=True, plain_ddp=False):
    """Data-parallel training on this rank's half of each global batch."""
    info = mdist.init(timeout_s=60)
    model = mpfp16.to_half(mlp(), getattr(torch, dtype))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               loss_scale=1024.0 if dtype == "float16" else None, master_weights=master_weights)
    if plain_ddp:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ddp = mdist.wrap(model, **wrap_kw)
    stats = []
    data = global_batches(steps * accum)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = data[step * accum + micro]
            with mdist.sync_gradients(ddp, micro == accum - 1):
                opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, info.world_size)),
                                                         shard(y, rank, info.world_size)) / accum)
        assert opt.step()
        if not plain_ddp:
            stats.append(mdist.comm_stats(ddp).pop_step())
    out = {"params": flat_params(model), "stats": stats}
    mdist.teardown()
    return out


def overflow_on_one_rank(rank, steps, where):
    """Rank 1 alone produces inf: in its input ('input', spread by the allreduce) or
    in its gradients after the allreduce ('grad', caught by the flag reduction)."""
    mdist.init(timeout_s=60)
    model = mpfp16.to_half(mlp(norm="bn"))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ddp = mdist.wrap(model)
    results = []
    for step, (x, y) in enumerate(global_batches(steps)):
        x, y = shard(x, rank, 2), shard(y, rank, 2)
        bad = rank == 1 and step in (2, 5)
        if bad and where == "input":
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(ddp(x), y))
        if bad and where == "grad":
            model[0].weight.grad[0, 0] = float("nan")
        results.append(opt.step())
    ddp.eval()
    with torch.no_grad():
        ddp(torch.zeros(2, 8))  # DDP broadcasts rank 0's buffers at each forward
    out = {"stepped": results, "skipped": opt.skipped_steps, "scale": opt.loss_scale,
           "params": flat_params(model), "buffers": [b.clone() for b in model.buffers()]}
    mdist.teardown()
    return out


def big_gradients(rank, wrap_kw):
    """Both ranks' gradient is 40000: the fp16 sum 80000 overflows, the average does not."""
    mdist.init(timeout_s=60)
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = mdist.wrap(model, **wrap_kw)
    ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).float().sum().backward()
    out = {"grad": model.weight.grad.float().item(), "stats": mdist.comm_stats(ddp).pop_step()}
    mdist.teardown()
    return out


def fp32_accumulate_exact(rank, chunk_numel, sizes, small_numel):
    """Odd sizes and tiny chunks (empty shards included) against a hand-computed average."""
    import torch.distributed as dist

    mdist.init(timeout_s=60)
    torch.manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.zeros(n, dtype=torch.float16)) for n in sizes])
    ddp = mdist.wrap(params_module(params), strategy="fp32_accumulate")
    ddp._mpfp16_hook_state.chunk_numel = chunk_numel
    ddp._mpfp16_hook_state.small_numel = small_numel
    g = torch.Generator().manual_seed(123)
    per_rank = [[torch.randn(n, generator=g).mul(30000).half() for n in sizes] for _ in range(2)]
    ddp(per_rank[rank]).backward()
    expected = [((a.float() + b.float()) / 2).half() for a, b in zip(*per_rank)]
    got = [p.grad.clone() for p in params]
    dist.barrier()
    mdist.teardown()
    return {"got": got, "expected": expected}


class params_module(nn.Module):
    """loss = sum(p * g) for given g: the gradient of p is exactly g."""

    def __init__(self, params):
        super().__init__()
        self.params = params

    def forward(self, grads):
        return sum((p.float() * g.float()).sum() for p, g in zip(self.params, grads))


def dead_peer(rank, mode):
    """Rank 1 exits (or hangs) after two steps; rank 0 must fail, not hang."""
    mdist.init(timeout_s=8)
    model = mpfp16.to_half(mlp())
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ddp = mdist.wrap(model)
    started = time.monotonic()
    try:
        for step, (x, y) in enumerate(global_batches(50)):
            if rank == 1 and step == 2:
                if mode == "exit":
                    os._exit(0)
                time.sleep(3600)
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, 2)), shard(y, rank, 2)))
            opt.step()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "elapsed": time.monotonic() - started}
    return {"error": None}


def log_levels(rank):
    import logging

    mdist.init(timeout_s=60)
    level = logging.getLogger("mpfp16").getEffectiveLevel()
    mdist.teardown()
    return level
