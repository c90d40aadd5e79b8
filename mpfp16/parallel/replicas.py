"""Are the data-parallel replicas still identical? One exact check across ranks.

Data-parallel training is correct only while every rank holds bit-identical
weights, masters and optimizer state. Nothing in DDP checks that: a gradient that
was never averaged, a checkpoint that differs between nodes or a kernel that rounds
differently on one rank all look like training. :func:`check_replicas` compares
everything a checkpoint would hold (the model's ``state_dict`` and the optimizer's)
across the ranks of a process group.

How, and what it costs. Each tensor's bytes are read as 64-bit integers and reduced
on its own device to two sums with wrap-around: the plain sum of the words and a
sum weighted by row (rows of 256 words). Integer sums are exact and independent of
the reduction order, so equal tensors always agree, and a difference in any single
element (one ulp of one weight included) always changes the plain sum; the
weighted sum also catches values swapped between rows. The per-tensor sums are
folded into two integers; with the count of tensors, a hash of their names, shapes
and dtypes, and a hash of the optimizer's numbers (scale, counters,
hyperparameters), one ``all_gather`` of those five integers per rank decides.
Only when something differs is a second collective made, to name the first tensor
that differs and the ranks on each side. Megatron-LM's
``check_param_hashes_across_dp_replicas`` copies every parameter to the host and
hashes it with SHA-256; this reads each byte once on the device and moves 40 bytes
per rank.
"""

from __future__ import annotations

import hashlib
import numbers

import torch
import torch.distributed as dist

from ..errors import ReplicaDivergenceError
from ..flat_buffers import is_dense
from .ranks import all_gather_object, get_world_size, group_ranks, is_initialized
from .fsdp_shim import is_sharded

__all__ = ["ReplicaDivergenceError", "check_replicas", "tensor_checksum"]

_ROW = 256  # int64 words per row of the row-weighted sum


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s bytes in memory order: as int64 words, and the last ``nbytes % 8`` bytes
    as one more word, zero-padded (a 0-dim int64 tensor; 0 when there are none)."""
    if t.is_contiguous():
        flat = t.reshape(-1)
    elif is_dense(t):  # channels_last and the like: the same bytes, in memory order
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
    else:
        flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    body = raw[:whole]
    if body.data_ptr() % 8:
        body = body.clone()
    tail = raw[whole:].to(torch.int64)  # little-endian: byte i is bits 8i..8i+7 of the padded word
    shifts = torch.arange(tail.numel(), dtype=torch.int64, device=tail.device) * 8
    return body.view(torch.int64), (tail << shifts).sum()


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bit pattern (module docstring), computed on its device
    without a host synchronization. Equal tensors give equal sums; tensors that differ
    in one element never do."""
    words, rest = _words(t.detach())
    rows = words.numel() // _ROW
    row_sums = words[: rows * _ROW].view(rows, _ROW).sum(1)
    last = words[rows * _ROW:].sum() + rest.sum()
    weights = torch.arange(1, rows + 1, dtype=torch.int64, device=words.device)
    return torch.stack([row_sums.sum() + last, (row_sums * weights).sum() + last * (rows + 1)])


def _walk(obj, path: str, tensors: list, numbers_: list) -> None:
    """Collect (path, tensor) and (path, value) leaves of a state_dict."""
    if isinstance(obj, torch.Tensor):
        tensors.append((path, obj))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, f"{path}.{key}" if path else str(key), tensors, numbers_)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, f"{path}.{i}", tensors, numbers_)
    elif obj is None or isinstance(obj, (numbers.Number, str, bool)):
        numbers_.append((path, obj))
    else:
        numbers_.append((path, repr(obj)))


def _param_names(module: torch.nn.Module, optimizer) -> list[str]:
    """Names of the optimizer's parameters in its state_dict's index order."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = (optimizer.model_params() if hasattr(optimizer, "model_params")
              else [p for group in optimizer.param_groups for p in group["params"]])
    return [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


def _readable(path: str, param_names: list[str]) -> str:
    """A place in what the check compares, as people say it: 'model.fc.weight' ->
    'fc.weight'; 'optimizer.state.fc.weight.exp_avg' -> "optimizer state 'exp_avg' of
    fc.weight"; 'params.fc.weight.master' -> 'master weight of fc.weight' (an
    FP16Optimizer's state keys its parameters by name, or by position without
    ``model=``; a plain torch optimizer's, by position)."""
    def named(key: str) -> str:
        if key.isdigit():
            index = int(key)
            return param_names[index] if index < len(param_names) else f"parameter {index}"
        return key

    if path.startswith("model."):
        return path[len("model."):]
    if path.startswith("optimizer.state.") and path.count(".") >= 3:
        key, state = path[len("optimizer.state."):].rsplit(".", 1)
        return f"optimizer state '{state}' of {named(key)}"
    if path.startswith("params.") and path.endswith(".master"):
        return f"master weight of {named(path[len('params.'):-len('.master')])}"
    return path


def collect(model: torch.nn.Module, optimizer=None, buffers: bool = True):
    """What the check compares: ([(path, tensor)], [(path, number or string)], the
    optimizer's parameter names in state_dict order)."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    tensors: list = []
    values: list = []
    buffer_names = {name for name, _ in module.named_buffers()}
    for name, t in module.state_dict().items():
        if buffers or name not in buffer_names:
            tensors.append((f"model.{name}", t))
    param_names: list[str] = []
    if optimizer is not None:
        param_names = _param_names(module, optimizer)
        state = optimizer.state_dict()
        if "optimizer" not in state:  # a plain torch optimizer: its state_dict is the inner one
            state = {"optimizer": state}
        _walk(state, "", tensors, values)
    # Sharded tensors (mpfp16.distributed.shard) differ between ranks by design: each
    # holds its own shard. What the ranks must share is the rest.
    tensors = [(path, t) for path, t in tensors if not is_sharded(t)]
    return tensors, values, param_names


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def local_summary(tensors: list, values: list, device: torch.device | None = None):
    """This rank's side of the check: ([count, structure hash, numbers hash, folded
    sum, folded weighted sum] as int64 on ``device``, the per-tensor sums)."""
    if device is None:
        device = next((t.device for _, t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    structure = _hash63(repr([(path, tuple(t.shape), str(t.dtype)) for path, t in tensors]))
    numbers_hash = _hash63(repr(values))
    if tensors:
        sums = torch.stack([tensor_checksum(t).to(device) for _, t in tensors])
        weights = torch.arange(1, len(tensors) + 1, dtype=torch.int64, device=device)
        folded = (sums * weights[:, None]).sum(0)
    else:
        sums = torch.zeros(0, 2, dtype=torch.int64, device=device)
        folded = torch.zeros(2, dtype=torch.int64, device=device)
    header = torch.tensor([len(tensors), structure, numbers_hash], dtype=torch.int64, device=device)
    return torch.cat([header, folded]), sums


def check_replicas(model: torch.nn.Module, optimizer=None, *, process_group=None, buffers: bool = True,
                   context: str = "") -> int:
    """Raise on every rank unless all ranks of ``process_group`` hold bit-identical
    state: the model's parameters and buffers, and the optimizer's state_dict (the
    fp32 masters and inner state of an :class:`mpfp16.FP16Optimizer`, the loss scale
    and counters). Of a sharded model, what is not sharded: its buffers, the loss
    scale, the counters and hyperparameters, and unsharded optimizer state.

    Args:
        model: the model, or the DDP module around it.
        optimizer: an FP16Optimizer or any ``torch.optim`` optimizer, or None.
        process_group: the data-parallel ranks (default: all).
        buffers: compare the model's buffers too. Under DDP, each rank's BatchNorm
            statistics move with its own batch after every forward, until the next
            forward broadcasts rank 0's: broadcast them first, or pass False.
        context: words for the error, such as ``" at step 120"``.

    Returns:
        The number of tensors compared (0 when not distributed: nothing to compare).

    Raises:
        ReplicaDivergenceError: on every rank, naming the first tensor (or optimizer
            value) that differs and which ranks hold which value.
    """
    if not is_initialized() or get_world_size(process_group) == 1:
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(process_group) == "nccl" else None
    tensors, values, param_names = collect(model, optimizer, buffers)
    summary, sums = local_summary(tensors, values, device)
    world = get_world_size(process_group)
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary, group=process_group)
    rows = torch.stack(gathered).tolist()  # the one host synchronization
    if all(row == rows[0] for row in rows):
        return len(tensors)
    report = {"paths": [p for p, _ in tensors], "sums": sums.cpu().tolist(), "values": values}
    reports = all_gather_object(report, group=process_group)
    raise ReplicaDivergenceError(_describe(reports, group_ranks(process_group), param_names, context))


def _sides(keys: list, ranks: list[int]) -> str:
    """'ranks 0, 2 hold one value, rank 1 another' from one key per rank."""
    groups: dict = {}
    for key, rank in zip(keys, ranks):
        groups.setdefault(repr(key), []).append(rank)
    parts = [("rank " if len(g) == 1 else "ranks ") + ", ".join(map(str, g)) for g in groups.values()]
    if len(parts) == 2:
        verb = "holds" if len(next(iter(groups.values()))) == 1 else "hold"
        return f"{parts[0]} {verb} one value, {parts[1]} another"
    return "; ".join(parts) + ": each a different value"


def _describe(reports: list[dict], ranks: list[int], param_names: list[str], context: str) -> str:
    paths = [r["paths"] for r in reports]
    if any(p != paths[0] for p in paths):
        counts = ", ".join(f"rank {rank}: {len(p)}" for rank, p in zip(ranks, paths))
        first = next(i for i in range(max(map(len, paths)))
                     if len({p[i] if i < len(p) else None for p in paths}) > 1)
        at = next(p[first] for p in paths if first < len(p))
        return (f"replicas diverged{context}: the ranks hold different sets of tensors ({counts}), "
                f"first at {_readable(at, param_names)}")
    differing = [i for i in range(len(paths[0])) if len({tuple(r["sums"][i]) for r in reports}) > 1]
    if differing:
        first = differing[0]
        return (f"replicas diverged{context}: {_readable(paths[0][first], param_names)} differs "
                f"({_sides([r['sums'][first] for r in reports], ranks)}); {len(differing)} of "
                f"{len(paths[0])} tensors differ")
    values = [dict(r["values"]) for r in reports]
    keys = list(dict.fromkeys(k for v in values for k in v))
    key = next(k for k in keys if len({repr(v.get(k)) for v in values}) > 1)
    shown = ", ".join(f"rank {rank}: {v.get(key)!r}" for rank, v in zip(ranks, values))
    return f"replicas diverged{context}: optimizer value {key} differs ({shown})"
