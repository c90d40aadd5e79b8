"""Functions that run inside the gloo tests of sharded training (tests/test_sharding.py)."""

from __future__ import annotations

import functools
import os
import pickle

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from mpfp16.convert import NORM_TYPES
from mpfp16.checkpoint import dcp as sharded_checkpoint
from mpfp16.bench import sharding as S
from mpfp16.errors import CheckpointError
from mpfp16.parallel.fsdp_shim import is_sharded


def in_process_group(worker):
    """Run ``worker(rank, ...)`` inside mpfp16.distributed.init() (gloo, from the
    environment run_workers sets) and teardown()."""
    @functools.wraps(worker)
    def run(rank, *args):
        mdist.init(backend="gloo", device="cpu")
        try:
            return worker(rank, *args)
        finally:
            mdist.teardown()

    return run


@in_process_group
def trajectories(rank, steps, kwargs):
    runs = {mode: S.trajectory(mode, steps, width=4, per_rank=4, **kwargs) for mode in S.MODES}
    return {"compare": S.compare(runs["ddp"], runs["sharded"]), **runs}


@in_process_group
def first_step(rank, clip, loss_scale="dynamic"):
    """One step of each path from the same weights and batch: gradient norms and masters."""
    out = {}
    for mode in S.MODES:
        torch.manual_seed(0)
        call, opt, model = S.build(mode, S.tiny_model(4), clip=clip, loss_scale=loss_scale)
        initial = S.masters(mode, model, opt)
        x, y = S.batch(0, 0, 4, 0, False)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(call(x).float(), y))
        assert opt.step()
        out[mode] = {"norm": opt.last_grad_norm, "masters": S.masters(mode, model, opt), "initial": initial,
                     "fp32": [name for name, p in model.named_parameters() if isinstance(
                         dict(model.named_modules())[name.rpartition(".")[0]], NORM_TYPES)]}
    return out


@in_process_group
def comm_per_step(rank, accum):
    torch.manual_seed(0)
    call, opt, model = S.build("sharded", S.tiny_model(4))
    stats = mdist.comm_stats(model)
    rows = []
    for step in range(2):
        opt.zero_grad()
        for micro in range(accum):
            x, y = S.batch(step, micro, 4, 0, False)
            with mdist.sync_gradients(model, micro == accum - 1):
                opt.backward(nn.functional.cross_entropy(call(x).float(), y) / accum)
        opt.step()
        rows.append(stats.pop_step())
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    return {"rows": rows, "units": units, "numel": sum(p.numel() for p in model.parameters())}


def _full(t):
    return t.full_tensor() if is_sharded(t) else t


def _snapshot(model, opt):
    masters = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    state = {f"{name}.{k}": _full(v).detach().clone() for name, s in opt.state_dict()["optimizer"]["state"].items()
             for k, v in s.items()}
    return {"masters": masters, "state": state, "scale": opt.loss_scale, "iteration": opt.iteration}


def _sharded_adam(seed):
    torch.manual_seed(seed)
    model = mdist.shard(S.tiny_model(4))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, max_grad_norm=1.0)
    return model, opt


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x, y = S.batch(step, 0, 4, 0, False)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x).float(), y))
        opt.step()


@in_process_group
def save_sharded(rank, path, steps):
    model, opt = _sharded_adam(0)
    _train(model, opt, steps)
    sharded_checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps})
    return _snapshot(model, opt)


@in_process_group
def load_sharded(rank, path):
    model, opt = _sharded_adam(1)  # other initial weights: everything must come from the checkpoint
    state = sharded_checkpoint.load(path, targets={"model": model.state_dict()})
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return {**_snapshot(model, opt), "step": state["step"]}


@in_process_group
def failed_save_keeps_previous(rank, folder):
    """A save that fails on one rank after writing part of its shards: every rank gets
    one error, the link still names the previous checkpoint, which loads."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(folder, "last.dcp")
    model, opt = _sharded_adam(0)
    _train(model, opt, 1)
    sharded_checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    before = _snapshot(model, opt)
    first = os.path.realpath(path)
    _train(model, opt, 1, start=1)
    real_write = dcp.FileSystemWriter.write_data

    def failing_write(self, plan, planner):  # rank 1's disk fills up while writing its shards
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real_write(self, plan, planner)

    dcp.FileSystemWriter.write_data = failing_write
    try:
        sharded_checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        dcp.FileSystemWriter.write_data = real_write
    still = os.path.realpath(path)
    model2, opt2 = _sharded_adam(1)
    state = sharded_checkpoint.load(path, targets={"model": model2.state_dict()})
    opt2.load_state_dict(state["optimizer"])
    return {"error": error, "first": first, "still": still, "before": before, "loaded": _snapshot(model2, opt2),
            "listing": sorted(os.listdir(folder))}


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@in_process_group
def unsafe_checkpoints(rank, folder):
    """Tampered checkpoints are refused in one line, and nothing in them runs."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model, opt = _sharded_adam(0)
    _train(model, opt, 1)
    results = {}
    marker = os.path.join(folder, "pwned")
    for case in ("code", "bytes", "missing-metadata", "garbage-meta"):
        path = os.path.join(folder, case, "last.dcp")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        sharded_checkpoint.save(path, {"model": model.state_dict()})
        md_path = os.path.join(path, ".metadata")
        if rank == 0:
            if case == "code":
                with open(md_path, "rb") as f:
                    md = pickle.load(f)
                md.storage_meta = _Payload(marker)
                with open(md_path, "wb") as f:
                    pickle.dump(md, f)
            elif case == "bytes":
                with open(md_path, "rb") as f:
                    md = pickle.load(f)
                key = next(iter(md.state_dict_metadata))
                md.state_dict_metadata[key] = BytesStorageMetadata()
                with open(md_path, "wb") as f:
                    pickle.dump(md, f)
            elif case == "missing-metadata":
                os.unlink(md_path)
            else:
                with open(os.path.join(path, "meta.pt"), "wb") as f:
                    f.write(b"\x80\x04garbage")
        torch.distributed.barrier()
        try:
            sharded_checkpoint.load(path, targets={"model": model.state_dict()})
            results[case] = None
        except CheckpointError as exc:
            results[case] = str(exc)
    results["marker_written"] = os.path.exists(marker)
    return results


@in_process_group
def refusals(rank):
    """What a sharded model refuses, each in one line."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    half = mpfp16.to_half(S.tiny_model(4))
    attempt("to_half first", lambda: mdist.shard(half))
    model = mdist.shard(S.tiny_model(4))
    attempt("shard twice", lambda: mdist.shard(model))
    attempt("channels_last", lambda: mdist.shard(S.tiny_model(4).to(memory_format=torch.channels_last)))
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    attempt("no masters", lambda: mpfp16.FP16Optimizer(sgd(), master_weights=False, model=model))
    attempt("fused", lambda: mpfp16.FP16Optimizer(sgd(), fused=True, model=model))
    attempt("no model", lambda: mpfp16.FP16Optimizer(sgd()))
    opt = mpfp16.FP16Optimizer(sgd(), model=model)
    out["type"] = type(opt).__name__
    out["store"] = opt.store.kind
    out["is FP16Optimizer"] = isinstance(opt, mpfp16.FP16Optimizer)
    attempt("step without backward", opt.step)
    x, y = S.batch(0, 0, 4, 0, False)
    nn.functional.cross_entropy(model(x).float(), y).backward()
    attempt("backward outside opt", opt.step)
    return out


@in_process_group
def memory(rank, optimizer):
    return S.memory_rows("resnet9-w16", [optimizer], ["ddp", "sharded"], image_size=32)


@in_process_group
def stuck_scale(rank):
    """NaN in one rank's batch at every step: the scale falls to its floor, then every
    rank raises LossScaleStuckError at the same step."""
    torch.manual_seed(0)
    scaler = mpfp16.DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    call, opt, model = S.build("sharded", S.tiny_model(4), loss_scale=scaler)
    for step in range(50):
        x, y = S.batch(step, 0, 4, 0, nan=True)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(call(x).float(), y))
        try:
            opt.step()
        except mpfp16.LossScaleStuckError as exc:
            return {"step": step, "error": str(exc), "skipped": opt.skipped_steps, "scale": opt.loss_scale}
    return {"step": None}


def _first_conv(model):
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def _train(call, opt, steps, start=0, nan_steps=()):
    stepped = []
    for step in range(start, start + steps):
        x, y = S.batch(step, 0, 4, 0, nan=step in nan_steps)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(call(x).float(), y))
        stepped.append(opt.step())
    return stepped


@in_process_group
def groups_and_freezing(rank):
    """Two ranks. (1) Each rank shards its own model over a mesh of itself alone: the
    overflow flag is reduced over that mesh's group, as the norm is, so rank 1's NaN
    skips rank 1's step only; an optimizer told to agree over all ranks instead is
    refused, and so is reduce_overflow=False. (2) The first conv frozen when the
    optimizer is built and unfrozen after 3 steps, sharded over both ranks and under
    DDP (which is built while it is trainable, with find_unused_parameters, so that it
    averages its gradient once it has one): the same masters, and the frozen weight
    never moved while frozen."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    out = {}
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    torch.manual_seed(0)
    model = mdist.shard(S.tiny_model(4), mesh=DeviceMesh.from_group(alone, "cpu"))
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    for name, kw in (("world group", {"process_group": dist.group.WORLD}), ("no reduce", {"reduce_overflow": False})):
        try:
            mpfp16.FP16Optimizer(sgd(), model=model, **kw)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    opt = mpfp16.FP16Optimizer(sgd(), model=model, loss_scale=64.0)
    out["stepped alone"] = _train(model, opt, 3, nan_steps=(1,) if rank == 1 else ())

    runs = {}
    for mode in ("ddp", "sharded"):
        torch.manual_seed(0)
        net = S.tiny_model(4)
        if mode == "ddp":
            mpfp16.to_half(net)
            call = mdist.wrap(net, find_unused_parameters=True)
            _first_conv(net).weight.requires_grad_(False)
        else:
            _first_conv(net).weight.requires_grad_(False)
            net = call = mdist.shard(net)
        # A scale that keeps the 16-bit gradients out of the subnormals, where FSDP2's
        # division before the sum rounds otherwise than DDP's after it.
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4),
                                   model=net, loss_scale=1024.0)
        before = S.masters(mode, net, opt)
        stepped = _train(call, opt, 3)
        frozen_name = next(n for n, p in net.named_parameters() if p is _first_conv(net).weight)
        while_frozen = S.masters(mode, net, opt)[frozen_name]
        _first_conv(net).weight.requires_grad_(True)
        stepped += _train(call, opt, 3, start=3)
        final = S.masters(mode, net, opt)
        runs[mode] = {"stepped": stepped, "masters": final, "name": frozen_name,
                      "frozen moved": not torch.equal(while_frozen, before[frozen_name]),
                      "moved once unfrozen": not torch.equal(final[frozen_name], while_frozen)}
    out["runs"] = runs
    net = mpfp16.to_half(S.tiny_model(4))
    _first_conv(net).weight.requires_grad_(False)
    call = mdist.wrap(net)
    _first_conv(net).weight.requires_grad_(True)
    try:
        call(S.batch(0, 0, 4, 0, False)[0])
        out["unfrozen under ddp"] = None
    except RuntimeError as exc:
        out["unfrozen under ddp"] = str(exc)
    return out


@in_process_group
def culprits(rank):
    """``last_overflow`` from the shards, gathered over the mesh: after a backward, rank
    0 writes one inf into its shard of 0.0.weight's gradient and each rank one NaN into
    its shard of 11.weight's (2 in all: the shards' counts add up); then rank 1's batch
    is NaN; then a clean step. Each step's (stepped, last_overflow), and the numel of
    every parameter by name."""
    torch.manual_seed(0)
    call, opt, model = S.build("sharded", S.tiny_model(4), clip=None)
    params = dict(model.named_parameters())
    reports = []
    for step in range(3):
        x, y = S.batch(step, 0, 4, 0, nan=step == 1)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(call(x).float(), y))
        if step == 0:
            with torch.no_grad():
                if rank == 0:
                    params["0.0.weight"].grad.to_local().view(-1)[0] = float("inf")
                params["11.weight"].grad.to_local().view(-1)[-1] = float("nan")
        reports.append((opt.step(), opt.last_overflow))
    return {"reports": reports, "numel": {name: p.numel() for name, p in params.items()}}
