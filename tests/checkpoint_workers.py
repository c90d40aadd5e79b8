"""Functions that run inside the gloo tests of mpfp16.checkpoint (tests/test_checkpoint.py):
one worker group runs every case, on 1 or 2 ranks."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from mpfp16 import checkpoint
from mpfp16.checkpoint import dcp
from mpfp16.errors import CheckpointError
from mpfp16.parallel.fsdp_shim import is_sharded
from mpfp16.train.models import resnet9
from sharding_workers import in_process_group


def _full(t):
    return t.full_tensor() if is_sharded(t) else t


def local_run(seed: int):
    """A 16-bit model with fp32 masters, the same on every rank (no DDP: nothing to average)."""
    torch.manual_seed(seed)
    model = mpfp16.to_half(resnet9(width=4, num_classes=10))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, max_grad_norm=1.0,
                               fused=False)
    return model, opt


def sharded_run(seed: int):
    torch.manual_seed(seed)
    model = mdist.shard(resnet9(width=4, num_classes=10))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, max_grad_norm=1.0)
    return model, opt


def train(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x).float(), y))
        opt.step()


def snapshot(model, opt) -> dict:
    """What a resume must restore, by parameter name, whole: the fp32 masters, the inner
    optimizer's state, the buffers, the scaler and the counters."""
    names = opt.param_names()
    inner = opt.state_dict()["optimizer"]["state"]
    return {
        "masters": {name: _full(m).detach().clone() for name, m in zip(names, opt.master_params())},
        "state": {f"{names[int(i)]}.{k}": _full(v).detach().clone() for i, s in inner.items() for k, v in s.items()},
        "buffers": {name: b.detach().clone() for name, b in model.named_buffers()},
        "scaler": opt.scaler.state_dict(), "skipped": opt.skipped_steps, "iteration": opt.iteration,
    }


def differences(a: dict, b: dict) -> list[str]:
    """The entries of two snapshots that are not bit-identical (empty: the same)."""
    out = []
    for part in ("masters", "state", "buffers"):
        if a[part].keys() != b[part].keys():
            out.append(f"{part}: other keys")
            continue
        out += [f"{part}.{k}" for k in a[part] if not (a[part][k].dtype == b[part][k].dtype
                                                       and torch.equal(a[part][k], b[part][k]))]
    out += [k for k in ("scaler", "skipped", "iteration") if a[k] != b[k]]
    return out


def read_into(path, model, opt) -> dict:
    state = checkpoint.read(path, model, opt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return snapshot(model, opt)


def as_old_flat(state: dict) -> dict:
    """An FP16Optimizer state as versions before the stores wrote it ("mpfp16.FP16Optimizer/1")."""
    old = {k: v for k, v in state.items() if k not in ("store", "param_names")}
    return {**old, "format": "mpfp16.FP16Optimizer/1"}


def as_old_sharded(state: dict) -> dict:
    """A sharded FP16Optimizer state as ShardedFP16Optimizer wrote it ("/sharded-1", keyed by name)."""
    names, inner = state["param_names"], state["optimizer"]
    return {
        "format": "mpfp16.FP16Optimizer/sharded-1",
        "optimizer": {"state": {names[int(i)]: dict(s) for i, s in inner["state"].items()},
                      "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                       for g in inner["param_groups"]]},
        "param_names": names, "param_shapes": state["param_shapes"], "compute_dtype": state["compute_dtype"],
        "scaler": state["scaler"], "scaler_type": state["scaler_type"], "skipped_steps": state["skipped_steps"],
        "iteration": state["iteration"],
    }


class _Broken:
    """The ``os`` module, with one function that raises ``error``."""

    def __init__(self, real, name: str, error: Exception) -> None:
        self._real, self._name, self._error = real, name, error

    def __getattr__(self, attr):
        if attr == self._name:
            def broken(*args, **kwargs):
                raise self._error
            return broken
        return getattr(self._real, attr)


def _failing(kind: str, rank: int, folder: str, model, opt) -> dict:
    """A save whose finishing rename (or link) raises a non-OSError on rank 0 alone:
    every rank gets the same one-line CheckpointError at once, and the previous
    checkpoint still reads."""
    fmt = checkpoint.DCP if kind.startswith("dcp") else checkpoint.FILE
    path = os.path.join(folder, "last" + fmt.suffix)
    fmt.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1})
    before = os.path.realpath(path)
    module = dcp if fmt is checkpoint.DCP else checkpoint.file
    name = {"dcp-rename": "rename", "dcp-link": "replace", "file-rename": "replace"}[kind]
    if rank == 0:  # only mpfp16's own call, not DCP's
        module.os = _Broken(os, name, RuntimeError(f"injected {kind} failure"))
    started = time.monotonic()
    try:
        fmt.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}, tag="step2")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        module.os = os
    seconds = time.monotonic() - started
    step = checkpoint.read(path, model, opt)["step"]
    listing = sorted(n for n in os.listdir(folder) if not n.startswith(".mpfp16"))
    return {"error": error, "seconds": seconds, "same": os.path.realpath(path) == before, "step": step,
            "listing": listing}


@in_process_group
def cases(rank: int, folder: str) -> dict:
    out = {}
    # A local run's file, read into a sharded model (other initial weights: all must come from the file).
    model, opt = local_run(0)
    train(model, opt, 2)
    out["local"] = snapshot(model, opt)
    checkpoint.FILE.save(os.path.join(folder, "local.pt"),
                         {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2})
    smodel, sopt = sharded_run(1)
    out["file into sharded"] = differences(read_into(os.path.join(folder, "local.pt"), smodel, sopt), out["local"])
    # It trains on, sharded; its DCP folder, read into local runs on every rank.
    train(smodel, sopt, 2, start=2)
    out["sharded"] = snapshot(smodel, sopt)
    dcp_path = os.path.join(folder, "sharded.dcp")
    checkpoint.DCP.save(dcp_path, {"model": smodel.state_dict(), "optimizer": sopt.state_dict(), "step": 4})
    lmodel, lopt = local_run(2)
    out["dcp into local"] = differences(read_into(dcp_path, lmodel, lopt), out["sharded"])
    smodel2, sopt2 = sharded_run(3)
    out["dcp into sharded"] = differences(read_into(dcp_path, smodel2, sopt2), out["sharded"])
    # Checkpoints in the formats written before one optimizer served every store.
    old_file = os.path.join(folder, "old.pt")
    checkpoint.FILE.save(old_file, {"model": lmodel.state_dict(), "optimizer": as_old_flat(lopt.state_dict())})
    out["old file into local"] = differences(read_into(old_file, *local_run(4)), out["sharded"])
    out["old file into sharded"] = differences(read_into(old_file, *sharded_run(5)), out["sharded"])
    old_dcp = os.path.join(folder, "old.dcp")
    checkpoint.DCP.save(old_dcp, {"model": smodel.state_dict(), "optimizer": as_old_sharded(sopt.state_dict())})
    out["old dcp into sharded"] = differences(read_into(old_dcp, *sharded_run(6)), out["sharded"])
    out["old dcp into local"] = differences(read_into(old_dcp, *local_run(7)), out["sharded"])
    # Finishing a save fails on rank 0 with something other than an OSError.
    for kind in ("dcp-rename", "dcp-link", "file-rename"):
        sub = os.path.join(folder, kind)
        os.makedirs(sub, exist_ok=True)
        run = (smodel, sopt) if kind.startswith("dcp") else (lmodel, lopt)
        out[kind] = _failing(kind, rank, sub, *run)
    return out
