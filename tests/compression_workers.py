"""Functions that run inside the 2-process gloo tests of torch's compression hooks
(tests/test_compression.py)."""

from __future__ import annotations

import gc
import io
import threading

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import mpfp16.distributed as mdist
from dist_workers import flat_params, global_batches, mlp, shard


def serialized_powersgd(state, bucket):
    """torch's powerSGD_hook, each bucket after the previous one's result: with more
    than one bucket on gloo, torch's hook alone can issue the ranks' collectives in
    different orders (and hang)."""
    torch_state, last = state
    if last:
        last[0].wait()
    last[:] = [powerSGD_hook(torch_state, bucket)]
    return last[0]


def torch_hook(strategy, rank, serialized=False):
    """torch's own hook and its state, registered the way torch's docs show."""
    if strategy == "fp16_compress":
        return None, default_hooks.fp16_compress_hook
    if strategy == "bf16_compress":
        return None, default_hooks.bf16_compress_hook
    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                          use_error_feedback=True, warm_start=True, random_seed=0)
    return ((state, []), serialized_powersgd) if serialized else (state, powerSGD_hook)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def cifar_batches(steps, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def build(arch):
    if arch == "mlp":
        return mlp()
    from mpfp16.train import models

    torch.manual_seed(0)
    return models.build_cifar_model(arch, 10)


def train(rank, ddp, opt, steps, first=0, arch="mlp"):
    """SGD steps on this rank's half of global batches first..first+steps-1; the
    per-step communication figures of a module made by wrap()."""
    stats = []
    batches = global_batches(first + steps) if arch == "mlp" else cifar_batches(first + steps)
    for x, y in batches[first:]:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        if mdist.comm_stats(ddp) is not None:
            stats.append(mdist.comm_stats(ddp).pop_step())
    return stats


def against_torch(rank, strategy, powersgd_rank, steps, bucket_mb, serialized=False):
    """The same fp32 model trained twice: plain DDP with torch's hook registered
    directly, and mpfp16.distributed.wrap(strategy=...)."""
    mdist.init(timeout_s=60)
    reference = mlp()
    ddp = nn.parallel.DistributedDataParallel(reference, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(*torch_hook(strategy, powersgd_rank, serialized))
    train(rank, ddp, sgd(reference), steps)
    model = mlp()
    wrapped = mdist.wrap(model, bucket_mb=bucket_mb, strategy=strategy, powersgd_rank=powersgd_rank)
    stats = train(rank, wrapped, sgd(model), steps)
    out = {"reference": flat_params(reference), "mpfp16": flat_params(model), "stats": stats}
    del ddp, wrapped
    mdist.teardown()
    out["threads"] = sorted(t.name for t in threading.enumerate())
    return out


def plain(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def powersgd_resume(rank, stops, steps, arch, bucket_mb=25, powersgd_rank=1):
    """Train ``steps`` steps straight, then again with a new model and DDP module after
    each of ``stops`` steps, the state carried through a checkpoint's plain form:
    the final weights of both, what each load returned, and the bucket layouts."""
    mdist.init(timeout_s=60)
    kw = dict(bucket_mb=bucket_mb, strategy="powersgd", powersgd_rank=powersgd_rank)
    model = build(arch)
    train(rank, mdist.wrap(model, **kw), sgd(model), steps, arch=arch)
    straight = flat_params(model)

    saved, done, reasons, layouts = None, 0, [], []
    for stop in [*stops, steps]:
        gc.collect()  # the previous DDP module goes here, not in a gloo thread's collection
        model = build(arch)
        ddp = mdist.wrap(model, **kw)
        opt = sgd(model)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            reasons.append(mdist.load_comm_state_dict(ddp, saved["comm"]))
        train(rank, ddp, opt, stop - done, first=done, arch=arch)
        saved = plain({"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "comm": mdist.comm_state_dict(ddp)})
        layouts.append(saved["comm"]["layout"])
        done = stop
    out = {"straight": straight, "resumed": flat_params(model), "reasons": reasons, "layouts": layouts,
           "definition_order": [name for name, _ in model.named_parameters()]}
    del ddp
    mdist.teardown()
    return out
