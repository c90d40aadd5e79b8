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
    saved = opt.state_dict()
    name_of = dict(zip(saved["params"], names))  # its keys: the names, or positions without model=
    inner = saved["optimizer"]["state"]
    return {
        "masters": {name: _full(m).detach().clone() for name, m in zip(names, opt.master_params())},
        "state": {f"{name_of[key]}.{k}": _full(v).detach().clone() for key, s in inner.items() for k, v in s.items()},
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
    state = checkpoint.read(path, model)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return snapshot(model, opt)


def as_old_flat(state: dict) -> dict:
    """An FP16Optimizer state as versions before the stores wrote it ("mpfp16.FP16Optimizer/1")."""
    old = {k: v for k, v in as_second_form(state).items() if k not in ("store", "param_names")}
    return {**old, "format": "mpfp16.FP16Optimizer/1"}


def as_second_form(state: dict) -> dict:
    """An FP16Optimizer state (mpfp16/state_format.py) as the version before it wrote it
    ("mpfp16.FP16Optimizer/2": keyed by index, a list of masters; a sharded store's
    masters in the model's state alone)."""
    keys = list(state["params"])
    index = {k: i for i, k in enumerate(keys)}
    entries = list(state["params"].values())
    sharded = state["store"] == "sharded"
    old = {k: v for k, v in state.items() if k not in ("params",)}
    old.update(format="mpfp16.FP16Optimizer/2", param_names=None if keys == [str(i) for i in range(len(keys))] else keys,
               param_shapes=[e["shape"] for e in entries],
               param_dtypes=["float32" if sharded else e["dtype"] for e in entries],
               master_params=[None if sharded or e["dtype"] == "float32" else e["master"] for e in entries],
               kahan_compensation=[],
               optimizer={"state": {index[k]: s for k, s in state["optimizer"]["state"].items()},
                          "param_groups": [{**g, "params": [index[k] for k in g["params"]]}
                                           for g in state["optimizer"]["param_groups"]]})
    if not sharded:
        old.pop("compute_dtype", None)
    return old


def as_old_sharded(state: dict) -> dict:
    """A sharded FP16Optimizer state as ShardedFP16Optimizer wrote it ("/sharded-1", keyed by name)."""
    state = as_second_form(state)
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
    step = checkpoint.read(path, model)["step"]
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


# ------------------------------------------------------------------ integrity (tests/test_integrity.py)


def training_state(model, opt, step: int) -> dict:
    """What the training scripts save (mpfp16.train.checkpointing.RunCheckpoints.state):
    every field of its schema, with this process's own values (a collective: rng)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scheduler = {**sched.state_dict(), "last_epoch": step, "_step_count": step + 1}  # one step per optimizer step
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler,
            "step": step, "epoch": 0, "batches_done": step, "best_acc1": -1.0, "best_epoch": None,
            "rng": mdist.all_gather_object(checkpoint.rng_state()), "elapsed": 1.5, "config": {"arch": "resnet9-w4"},
            "run": {"processes": mdist.get_world_size()}}


# A hand-edited training checkpoint that keeps its format marker: (field, new value or REMOVE).
REMOVE = "<removed>"
EDITS = [("scheduler", REMOVE), ("rng", REMOVE), ("step", REMOVE), ("epoch", REMOVE), ("batches_done", REMOVE),
         ("best_acc1", REMOVE), ("best_epoch", REMOVE), ("step", "eight"), ("step", -1), ("step", 2.5),
         ("step", True), ("epoch", None), ("batches_done", "3"), ("best_acc1", "high"), ("best_epoch", "one"),
         ("scheduler", [1, 2]), ("scheduler", {"base_lrs": [0.1]}), ("rng", "seed"), ("rng", []),
         ("rng", [{"torch": "state", "python": (3, (1, 2), None)}]), ("elapsed", "long"), ("config", [1]),
         ("run", 7), ("comm", {"rank": 0})]
# The same checks on a DCP folder's meta.pt (one schema serves both: a sample of the matrix).
DCP_EDITS = [EDITS[i] for i in (0, 1, 2, 7, 11, 12, 15, 18)]


def edited(state: dict, field: str, value) -> dict:
    out = {k: v for k, v in state.items() if k != field}
    if value is not REMOVE and value != REMOVE:
        out[field] = value
    return out


def schema_error(path: str, model, opt) -> str | None:
    """What resuming from ``path`` says, through mpfp16.checkpoint.read and the
    training checkpoint's schema (as RunCheckpoints.resume checks it)."""
    from mpfp16.train.checkpointing import check_training_state

    where = os.path.join(path, dcp.META) if checkpoint.format_of(path) is checkpoint.DCP else path
    try:
        checkpoint.read(path, model, check=lambda s: check_training_state(s, where))
    except CheckpointError as exc:
        return str(exc)
    return None


def _flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def tensor_data_spans(blob: bytes, base: int = 0) -> list[tuple[str, int, int]]:
    """(entry, start, length) of every tensor storage in a torch.save zip held in
    ``blob`` (which starts at byte ``base`` of its file): the bytes a flipped bit
    corrupts without breaking the file's structure."""
    import io
    import struct
    import zipfile

    spans = []
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        for info in z.infolist():
            if "/data/" not in info.filename or info.file_size == 0 or info.filename.endswith(".pkl"):
                continue
            name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
            start = info.header_offset + 30 + name_len + extra_len
            spans.append((info.filename, base + start, info.file_size))
    return spans


def _dcp_spans(path: str) -> list[tuple[str, str, int, int]]:
    """(tensor fqn, shard file, start, length) of each saved chunk's tensor bytes."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = dcp._MetadataUnpickler(f).load()
    spans = []
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        for _, start, length in tensor_data_spans(blob, info.offset):
            spans.append((index.fqn, info.relative_path, start, length))
    return spans


def _attempt_load(path, model, opt) -> str | None:
    try:
        checkpoint.read(path, model)
    except CheckpointError as exc:
        return str(exc)
    return None


@in_process_group
def integrity_cases(rank: int, folder: str, tmpfs: str | None) -> dict:
    """The sharded format's checks, on every rank: a flipped bit in a shard file and in
    meta.pt, old checkpoints without checksums, a truncated .metadata, a missing shard
    file, hand-edited fields, a user's copy of a checkpoint folder, a full disk."""
    import random
    import shutil

    barrier = torch.distributed.barrier
    out = {}
    model, opt = sharded_run(0)
    train(model, opt, 1)
    path = os.path.join(folder, "last.dcp")
    checkpoint.DCP.save(path, training_state(model, opt, 1), tag="step1")
    out["clean"] = _attempt_load(path, *sharded_run(1))
    # One flipped bit in a sample of every rank's chunks, and in meta.pt's plain tensors.
    spans = _dcp_spans(path)
    rng = random.Random(0)
    sample = rng.sample(spans, 10)
    with open(os.path.join(path, dcp.META), "rb") as f:
        meta_spans = tensor_data_spans(f.read())
    flips = [(fqn, os.path.join(path, f), start + rng.randrange(length), rng.randrange(8))
             for fqn, f, start, length in sample]
    flips += [(name, os.path.join(path, dcp.META), start + rng.randrange(length), rng.randrange(8))
              for name, start, length in rng.sample(meta_spans, 4)]
    out["flips"] = []
    for fqn, file_, offset, bit in flips:
        if rank == 0:
            _flip(file_, offset, bit)
        barrier()
        sharded_error = _attempt_load(path, *sharded_run(2))
        whole_error = _attempt_load(path, *local_run(3))  # each rank reads it whole
        barrier()
        if rank == 0:
            _flip(file_, offset, bit)
        barrier()
        out["flips"].append({"fqn": fqn, "file": os.path.basename(file_), "sharded": sharded_error,
                             "whole": whole_error})
    # Written before checksums existed: loads, and nothing is said.
    old = os.path.join(folder, "old.dcp")
    dcp.save(old, {"format": checkpoint.FORMAT, **training_state(model, opt, 1)}, checksum=False)
    out["old"] = _attempt_load(old, *sharded_run(4))
    out["old has none"] = "checksums" not in dcp.read_meta(old)["state"]
    # 11 b: a truncated .metadata; c: a missing shard file.
    for case in ("truncated", "missing-shard"):
        sub = os.path.join(folder, case, "last.dcp")
        os.makedirs(os.path.dirname(sub), exist_ok=True)
        checkpoint.DCP.save(sub, training_state(model, opt, 1))
        if rank == 0:
            if case == "truncated":
                md = os.path.join(sub, ".metadata")
                os.truncate(md, os.path.getsize(md) // 2)
            else:
                os.unlink(os.path.join(sub, "__1_0.distcp"))
        barrier()
        out[case] = {"sharded": _attempt_load(sub, *sharded_run(5)), "whole": _attempt_load(sub, *local_run(6))}
    # 9: hand-edited fields of meta.pt, its format marker kept.
    out["edits"] = {}
    for field, value in DCP_EDITS:
        sub = os.path.join(folder, f"edit-{field}-{value}".replace("/", "_").replace(" ", ""), "last.dcp")
        os.makedirs(os.path.dirname(sub), exist_ok=True)
        checkpoint.DCP.save(sub, training_state(model, opt, 1))
        if rank == 0:
            meta_path = os.path.join(sub, dcp.META)
            meta = torch.load(meta_path, weights_only=True)
            meta["state"] = edited(meta["state"], field, value)
            torch.save(meta, meta_path)
        barrier()
        out["edits"][(field, repr(value))] = schema_error(sub, *sharded_run(7))
    # 11 d: a sharded optimizer state given to an unsharded optimizer: taken directly (the one state form)
    lmodel, lopt = local_run(8)
    try:
        lopt.load_state_dict(opt.state_dict())
        out["sharded into local"] = None
        out["sharded into local, masters"] = all(
            torch.equal(_full(p), m) for p, m in zip(opt.master_params(), lopt.master_params()))
    except ValueError as exc:
        out["sharded into local"] = str(exc)
    out["sharded into local, read"] = _attempt_load(path, lmodel, lopt)
    # 5: a user's copy of a complete checkpoint folder, beside the run's.
    run = os.path.join(folder, "run")
    os.makedirs(run, exist_ok=True)
    last = os.path.join(run, "last.dcp")
    checkpoint.DCP.save(last, training_state(model, opt, 1), tag="step1")
    first = os.readlink(last)
    if rank == 0:
        shutil.copytree(os.path.join(run, first), os.path.join(run, "sharded-backup"))
        open(os.path.join(run, ".sharded-step2-dead.tmp"), "w").close()
    barrier()
    out["swept"] = checkpoint.remove_unfinished(run) if rank == 0 else None
    barrier()
    checkpoint.DCP.save(last, training_state(model, opt, 2), tag="step2")
    checkpoint.DCP.keep_as_best(last, os.path.join(run, "best.dcp"))
    checkpoint.DCP.save(last, training_state(model, opt, 3), tag="step3")
    out["run listing"] = sorted(n for n in os.listdir(run) if not n.startswith(".mpfp16"))
    out["first"], out["best"], out["last"] = first, os.readlink(os.path.join(run, "best.dcp")), os.readlink(last)
    out["backup"] = _attempt_load(os.path.join(run, "sharded-backup"), *sharded_run(9))
    # 2: a full disk (a tmpfs that holds one checkpoint, not two).
    if tmpfs is not None:
        full = os.path.join(tmpfs, "last.dcp")
        checkpoint.DCP.save(full, training_state(model, opt, 1), tag="step1")
        before = os.readlink(full)
        try:
            checkpoint.DCP.save(full, training_state(model, opt, 2), tag="step2")
            out["full"] = None
        except CheckpointError as exc:
            out["full"] = str(exc)
        barrier()
        out["full kept"] = os.readlink(full) == before
        out["full step"] = checkpoint.read(full, sharded_run(10)[0])["step"]
        out["full listing"] = sorted(n for n in os.listdir(tmpfs) if not n.startswith(".mpfp16"))
    return out
