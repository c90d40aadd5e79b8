"""Functions that run inside the 2-process gloo tests of the 8-bit and top-k wires
(tests/test_wires.py): each rank records its own gradient beside the wire's average,
so that the test can compute the exchange from both ranks' gradients by itself."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from compression_workers import plain
from dist_workers import flat_params, global_batches, shard


def net(seed=0):
    """Parameters of 768, 96, 384 and 4 elements: 3, 1, 2 and 1 rows of 256, two of
    them padded, so that rows of one parameter have different owners."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 96), nn.ReLU(), nn.Linear(96, 4))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _finite(grads: dict) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def wire_run(rank, kw, steps, bucket_mb=25, accum=1, nan_at=None, dtype="float32"):
    """SGD (no momentum) on this rank's half of each global batch through
    ``mdist.wrap(**kw)``: per step, this rank's own gradient (a plain copy of the
    model, the same weights and micro-batches), the average the wire wrote, the wire's
    state before and after, and the comm figures. ``nan_at``: the step whose first
    input on rank 1 is NaN (skipped where the average is not finite). ``accum``:
    micro-batches per step, all but the last under ``no_sync``."""
    mdist.init(timeout_s=60)
    model, local = net(), net()
    if dtype != "float32":
        mpfp16.to_half(model, getattr(torch, dtype))
        mpfp16.to_half(local, getattr(torch, dtype))
    as_input = getattr(torch, dtype)
    ddp = mdist.wrap(model, bucket_mb=bucket_mb, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps_out = []
    batches = global_batches(steps * accum)
    for step in range(steps):
        micro = [(shard(x, rank, 2), shard(y, rank, 2)) for x, y in batches[step * accum:(step + 1) * accum]]
        if step == nan_at and rank == 1:
            micro[-1] = (micro[-1][0].clone().index_fill_(0, torch.tensor([0]), float("nan")), micro[-1][1])
        with torch.no_grad():
            for p, q in zip(local.parameters(), model.parameters()):
                p.copy_(q)
        local.zero_grad()
        for xs, ys in micro:
            nn.functional.cross_entropy(local(xs.to(as_input)), ys).backward()
        before = mdist.comm_state_dict(ddp)
        opt.zero_grad()
        for i, (xs, ys) in enumerate(micro):
            if i < len(micro) - 1:
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(xs.to(as_input)), ys).backward()
            else:
                nn.functional.cross_entropy(ddp(xs.to(as_input)), ys).backward()
        average = _grads(model)
        finite = _finite(average)
        if finite:  # as mpfp16's optimizer does: a step with inf or NaN gradients is skipped
            opt.step()
        steps_out.append({"local": _grads(local), "average": average, "finite": finite, "before": before,
                          "after": mdist.comm_state_dict(ddp), "stats": mdist.comm_stats(ddp).pop_step()})
    out = {"steps": steps_out, "params": flat_params(model)}
    del ddp
    mdist.teardown()
    return out


def wire_resume(rank, kw, stops, steps, bucket_mb):
    """``steps`` steps straight, then again with a new model and DDP module after each
    of ``stops`` steps, the wire's state carried through a checkpoint's plain form:
    the final weights of both and what each load returned."""
    mdist.init(timeout_s=60)
    batches = global_batches(steps)

    def train(ddp, model, opt, first, last):
        for x, y in batches[first:last]:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            opt.step()

    model = net()
    ddp = mdist.wrap(model, bucket_mb=bucket_mb, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(ddp, model, opt, 0, steps)
    straight = flat_params(model)
    saved, done, reasons = None, 0, []
    for stop in [*stops, steps]:
        del ddp
        gc.collect()
        model = net()
        ddp = mdist.wrap(model, bucket_mb=bucket_mb, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            reasons.append(mdist.load_comm_state_dict(ddp, saved["comm"]))
        train(ddp, model, opt, done, stop)
        saved = plain({"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "comm": mdist.comm_state_dict(ddp)})
        done = stop
    out = {"straight": straight, "resumed": flat_params(model), "reasons": reasons}
    del ddp
    mdist.teardown()
    return out


def poisoned_script_runs(rank, runs, ports):
    """train_cifar's runs in order (dist_helpers.scripts), rank 1's batch at its 4th
    optimizer step holding a NaN."""
    from dist_helpers import _script_runs
    from fault_workers import poison

    poison(4, 4, ranks=(1,))
    return _script_runs(rank, "train_cifar", runs, ports, None)
