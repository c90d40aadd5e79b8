"""The bandwidth study: fp16 vs fp32 gradient allreduce, from one collective to a training step.

Run under torchrun (gloo on CPU, NCCL on GPU):

    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --sizes 4K,1M,16M,100M --json sweep.json --plot sweep.png
    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --model resnet18 --accum 4
    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --model imagegpt-s --seq-len 16 --batch-size 1 --accum 32

Collective sweep (default). For each size, every type averages the same number of
elements, count = size / 4: the fp32 message is ``size`` bytes and a 16-bit one half
of it. Types: ``fp32``, ``fp16``, ``bf16`` (one ``all_reduce`` each) and, with
``--strategies`` including ``fp32_accumulate``, ``fp16+acc32`` and ``bf16+acc32``
(mpfp16's 16-bit wire with fp32 sums), and, with ``--wires`` (default: all of
them; ``none`` for none), mpfp16's exchanges below 16 bits (mpfp16.parallel.wires):
``fp8-e4m3``, ``fp8-e5m2``, ``int8`` (8-bit codes and an fp32 scale per 256
elements, a reduce-scatter and an all-gather, fp32 sums), each also with error
feedback (``+ef``: the same bytes, one more pass), and ``topk-1%``, ``topk-0.1%``
(Deep Gradient Compression: fp32 values and int32 indices, all-gathered). A wire's
row counts one rank's message: codes and scales, or values and indices, the bytes
mpfp16's comm accounting counts. The types run alternately, one iteration each per
round, after ``--warmup`` rounds; each iteration is timed between barriers and the
slowest rank's time counts; the table gives the median, the min and the max, and
each type's time and bytes over fp32's at the same element count. As in nccl-tests
(doc/PERFORMANCE.md): algbw = bytes / time; busbw = algbw * 2(n-1)/n for an
allreduce (the 8-bit wires' reduce-scatter and all-gather too), the rate each
rank's link must sustain, comparable across world sizes; for top-k's all-gather of
one message per rank, busbw = (n-1) x bytes / time.

Training-step view (``--model``). The gradients of a real model (a torchvision model
on random images, or a GPT size from mpfp16.train.gpt on random tokens), synced
by DDP with mpfp16's hooks, in up to four set-ups (``--setups``): an fp32 model; an
fp16 model with the fp16 allreduce; fp16 with an fp32 allreduce; fp16 with the
fp32-accumulate strategy; torch's compression hooks and mpfp16's 8-bit and top-k
wires on an fp32 model (``fp32-fp8-e4m3``, ``fp32-int8-ef``, ``fp32-topk-0.01``, ...;
under top-k SGD runs without momentum and the exchange applies it, as DGC does);
and, with ``fp16-sharded``, fp32 masters sharded by FSDP2
(:func:`mpfp16.distributed.shard`), whose gradient reduce-scatters and parameter
all-gathers replace the allreduce (its one-process row is the unsharded fp16 model).
The optimizer is SGD with momentum; ``--accumulate-dtype fp32`` builds it with
``accumulate_dtype=torch.float32`` (the micro-batches' gradients summed in fp32, the
step's exchanges carrying the sum: the same bytes on the wire).
Each runs ``--accum`` micro-batches per optimizer step, once with an allreduce on
every micro-batch and once with ``no_sync`` on all but the last; a one-process
baseline (rank 0 alone, the others idle) gives the compute-only rate. The table
reports per-rank micro-batches per second, the step time's min, median and max over
the timed steps (the slowest rank's), bytes and allreduce calls per optimizer step,
the time communication was in flight, and the part of it backward did not hide
(exposed), with the bytes and both times over the fp32 model's row of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel import hooks
from ..parallel.wires import WireMemory, WireOptions, average_8bit, average_topk
from .. import distributed as mdist
from ..train.gpt import GPT_SIZES, build_gpt, next_token_loss
from .links import LinkError, WireCounter
from .timing import time_call

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --wires: mpfp16's 8-bit and top-k exchanges (mpfp16.parallel.wires) -> their WireOptions. Error feedback
# sends the same bytes and adds a pass over the residual; top-k's momentum is DGC's 0.9 (its cost does not
# depend on it).
WIRES = {
    "fp8-e4m3": {"strategy": "fp8_compress", "fp8_format": "e4m3"},
    "fp8-e4m3+ef": {"strategy": "fp8_compress", "fp8_format": "e4m3", "error_feedback": True},
    "fp8-e5m2": {"strategy": "fp8_compress", "fp8_format": "e5m2"},
    "fp8-e5m2+ef": {"strategy": "fp8_compress", "fp8_format": "e5m2", "error_feedback": True},
    "int8": {"strategy": "int8_compress"},
    "int8+ef": {"strategy": "int8_compress", "error_feedback": True},
    "topk-1%": {"strategy": "topk", "topk_ratio": 0.01, "topk_momentum": 0.9},
    "topk-0.1%": {"strategy": "topk", "topk_ratio": 0.001, "topk_momentum": 0.9},
}
ACCUMULATE_DTYPES = {None: None, "fp32": torch.float32}  # --accumulate-dtype: FP16Optimizer's accumulate_dtype


def parse_size(text: str) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '100' -> 100 (binary suffixes, as nccl-tests)."""
    text = text.strip().upper()
    mult = SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SUFFIXES else text
    try:
        value = float(digits) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 64K, 25M, 1G)") from None
    if value < 4 or value != int(value):
        raise argparse.ArgumentTypeError(f"a size must be a whole number of bytes >= 4, got {text!r}")
    return int(value)


def parse_list(choices, allow_none: bool = False):
    """A comma-separated list of ``choices`` (``none``: the empty list, where
    ``allow_none``); one line naming the first item refused."""
    def parse(text: str) -> list[str]:
        if allow_none and text.strip().lower() == "none":
            return []
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            what = f"unknown {bad[0]!r}: " if bad else ""
            raise argparse.ArgumentTypeError(f"{what}expected a comma-separated list of {', '.join(choices)}"
                                             + (" (or none)" if allow_none else ""))
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{text!r} names one twice")
        return items
    return parse


def busbw_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor, 2(n-1)/n: a ring allreduce moves
    each byte over 2(n-1) links while n ranks share the work."""
    return 2.0 * (world_size - 1) / world_size


def bandwidths(size_bytes: int, seconds: float, world_size: int, collective: str = "all_reduce") -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second). ``size_bytes`` is one rank's
    message. An ``all_reduce`` (the 8-bit wires' reduce-scatter and all-gather
    included: each rank sends 2(n-1)/n of its encoded buffer) scales algbw by
    :func:`busbw_factor`; an ``all_gather`` of one message per rank (top-k's values
    and indices) is counted as nccl-tests counts it, on the gathered n x size_bytes
    with factor (n-1)/n, so busbw = (n-1) x size_bytes / time."""
    algbw = size_bytes / seconds / 1e9
    if collective == "all_gather":
        return algbw, algbw * (world_size - 1)
    return algbw, algbw * busbw_factor(world_size)


def over_ranks(value: float, device: torch.device, op=dist.ReduceOp.MAX) -> float:
    """``value`` reduced over the ranks (default: the largest)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def timed(fn, device: torch.device) -> float:
    """Seconds for one call of ``fn``, between barriers (CUDA events on GPU); the
    slowest rank's."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return over_ranks(time_call(fn, device), device)


# ----------------------------------------------------------------- collective sweep


def wire_message_bytes(options: WireOptions, count: int, world: int) -> int:
    """The bytes of one rank's message when ``options``' wire averages one tensor of
    ``count`` elements: 8-bit codes and an fp32 scale per 256-element row (the last
    row padded), or top-k's fp32 values and int32 indices; what CommStats counts."""
    memory = WireMemory(options, {"x": torch.empty(count, device="meta")})
    layout = memory.layout_of(("x",), world, torch.device("cpu"))
    return sum(n * dtype.itemsize for dtype, n in memory.message(layout).items())


def _wire_method(name: str, base: torch.Tensor, device: torch.device):
    """(average, reset, message bytes) of sweep type ``name`` (a key of WIRES) on a
    copy of ``base``: ``average()`` runs the wire's exchange on one tensor, carrying
    its state (residual, top-k's momentum and accumulation) from call to call as
    training does; ``reset()``, outside the timing, puts the gradient back (the
    exchange writes the average over it)."""
    options = WireOptions(**WIRES[name])
    world = dist.get_world_size()
    buf = base.clone()
    memory = WireMemory(options, {"x": buf})
    layout = memory.layout_of(("x",), world, device)
    state = [{kind: torch.zeros(layout.state_numel(options.strategy), device=device) for kind in options.kinds}]
    average = average_topk if options.strategy == "topk" else average_8bit

    def run() -> None:
        state[0] = average(buf, layout, options, dist.group.WORLD, state[0])

    return run, (lambda: buf.copy_(base)), wire_message_bytes(options, base.numel(), world)


def sweep_methods(count: int, dtypes: list[str], strategies: list[str], device: torch.device,
                  wires: list[str] = ()) -> dict:
    """type name -> (function averaging `count` elements, one rank's message bytes,
    the collective it counts as, a reset to run before each timed call or None)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    base = torch.randn(count, generator=g).to(device)
    state = hooks.HookState()
    methods = {}
    for name in dtypes:
        buf = base.to(DTYPES[name])
        nbytes = count * DTYPES[name].itemsize
        if "allreduce" in strategies or name == "fp32":
            methods[name] = ((lambda b: lambda: dist.all_reduce(b))(buf), nbytes, "all_reduce", None)
        if "fp32_accumulate" in strategies and name != "fp32":
            methods[f"{name}+acc32"] = ((lambda b: lambda: hooks.average_fp32_accumulate(state, b))(buf.clone()),
                                        nbytes, "all_reduce", None)
    for name in wires:
        run, reset, nbytes = _wire_method(name, base, device)
        methods[name] = (run, nbytes, "all_gather" if WIRES[name]["strategy"] == "topk" else "all_reduce", reset)
    return methods


def sweep(sizes: list[int], dtypes: list[str], strategies: list[str], iters: int, warmup: int,
          device: torch.device, wire: WireCounter | None = None, wires: list[str] = ()) -> list[dict]:
    """The sweep's rows: per size and type, the median time and its min and max over
    the ``iters`` timed rounds. With ``wire``, each row also has ``wire_bytes``: the
    bytes the busiest node sent on its interface per call (median), headers and the
    timing's barrier and all-reduce of one number (a few hundred bytes) included."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        count = size // 4
        methods = sweep_methods(count, dtypes, strategies, device, wires)
        times = {name: [] for name in methods}
        sent = {name: [] for name in methods}
        for i in range(warmup + iters):
            for name, (fn, _, _, reset) in methods.items():
                if reset is not None:
                    reset()
                before = wire.read() if wire is not None else 0
                t = timed(fn, device)
                if wire is not None:
                    # read after timed()'s closing all-reduce: by then the peer has received
                    # everything, so nothing of this call still waits in the qdisc uncounted
                    sent[name].append(wire.read() - before)
                if i >= warmup:
                    times[name].append(t)
        for name, (_, nbytes, collective, _) in methods.items():
            seconds = statistics.median(times[name])
            algbw, busbw = bandwidths(nbytes, seconds, world, collective)
            row = {"size_bytes": nbytes, "count": count, "dtype": name, "time_us": seconds * 1e6,
                   "time_min_us": min(times[name]) * 1e6, "time_max_us": max(times[name]) * 1e6,
                   "repeats": len(times[name]), "algbw_gbps": algbw, "busbw_gbps": busbw}
            if wire is not None:
                row["wire_bytes"] = over_ranks(statistics.median(sent[name][warmup:]), device)
            rows.append(row)
        del methods
    return rows


def fp32_ratios(rows: list[dict], key: str = "time_us", group: tuple[str, ...] = ("count",),
                name: str = "dtype", baseline: str = "fp32") -> list[float | None]:
    """For each row, its ``key`` over the ``baseline`` row's with the same ``group``
    fields (the same run's: rows of other runs are never mixed); None where that
    run has no baseline row or it is 0."""
    base = {tuple(r.get(g) for g in group): r.get(key) for r in rows if r[name] == baseline}
    out = []
    for r in rows:
        b = base.get(tuple(r.get(g) for g in group))
        out.append(r[key] / b if b and r.get(key) is not None else None)
    return out


def _ratio(value: float | None, width: int = 7, digits: int = 2) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def sweep_table(rows: list[dict]) -> str:
    """nccl-tests-like table: each type's median time, min and max, then its time and
    its message bytes relative to fp32 at equal count (and, measured on a link, the
    interface bytes)."""
    wired = any("wire_bytes" in r for r in rows)
    times = fp32_ratios(rows)
    sizes = fp32_ratios(rows, "size_bytes")
    lines = [f"{'size':>12} {'count':>12} {'type':>11} {'time_us':>11} {'min':>11} {'max':>11} {'algbw':>8} "
             f"{'busbw':>8}   {'vs fp32':>7} {'bytes vs fp32':>13}" + (f" {'wire_bytes':>12}" if wired else "")]
    for r, t, b in zip(rows, times, sizes):
        lines.append(f"{r['size_bytes']:>12} {r['count']:>12} {r['dtype']:>11} {r['time_us']:>11.1f} "
                     f"{r.get('time_min_us', r['time_us']):>11.1f} {r.get('time_max_us', r['time_us']):>11.1f} "
                     f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f}   {_ratio(t)} {_ratio(b, 13, 3)}"
                     + (f" {r.get('wire_bytes', 0):>12.0f}" if wired else ""))
    return "\n".join(lines)


def plot_sweep(rows: list[dict], path: str, title: str) -> None:
    """Left: bus bandwidth against message size, per type. Right: time relative to the
    fp32 allreduce of the same number of elements (below 1: the type pays)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp32 = {r["count"]: r["time_us"] for r in rows if r["dtype"] == "fp32"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r["dtype"] for r in rows))
    colors = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    for i, name in enumerate(names):
        mine = [r for r in rows if r["dtype"] == name]
        style = {"marker": "o", "label": name, "color": colors(i % colors.N)}
        left.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], **style)
        if name != "fp32":
            pts = [(r["count"], r["time_us"] / fp32[r["count"]]) for r in mine if r["count"] in fp32]
            right.plot(*zip(*pts), **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_xlabel("message size (bytes)")
    left.set_ylabel("bus bandwidth (GB/s)")
    left.set_title(title)
    right.axhline(1.0, color="gray", lw=1)
    right.axhline(0.5, color="gray", lw=1, ls=":")
    right.axhline(0.25, color="gray", lw=1, ls="--")
    right.set_yscale("log")
    right.set_xlabel("elements")
    right.set_ylabel("time / fp32 time, same elements")
    right.set_title("vs fp32 (dotted: half the bytes; dashed: a quarter)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------- training-step view

SETUPS = {  # key: (name, model precision, wrap() arguments)
    "fp32": ("fp32 model", "fp32", {}),
    "fp16": ("fp16, fp16 allreduce", "fp16", {}),
    "fp16-fp32-allreduce": ("fp16, fp32 allreduce", "fp16", {"allreduce_dtype": torch.float32}),
    "fp16-fp32-accumulate": ("fp16, fp32-accumulate", "fp16", {"strategy": "fp32_accumulate"}),
    # torch's own compression hooks, on an fp32 model: the baselines users already have
    "fp32-fp16-compress": ("fp32, fp16_compress_hook", "fp32", {"strategy": "fp16_compress"}),
    "fp32-bf16-compress": ("fp32, bf16_compress_hook", "fp32", {"strategy": "bf16_compress"}),
    "fp32-powersgd-r1": ("fp32, PowerSGD rank 1", "fp32", {"strategy": "powersgd", "powersgd_rank": 1}),
    "fp32-powersgd-r4": ("fp32, PowerSGD rank 4", "fp32", {"strategy": "powersgd", "powersgd_rank": 4}),
    # mpfp16's 8-bit and top-k wires (mpfp16.parallel.wires), on an fp32 model; top-k applies SGD's momentum
    # in the exchange (DGC's momentum correction), so its optimizer runs without (TOPK_MOMENTUM)
    "fp32-fp8-e4m3": ("fp32, fp8 e4m3", "fp32", {"strategy": "fp8_compress", "fp8_format": "e4m3"}),
    "fp32-fp8-e4m3-ef": ("fp32, fp8 e4m3 + EF", "fp32", {"strategy": "fp8_compress", "fp8_format": "e4m3",
                                                         "error_feedback": True}),
    "fp32-fp8-e5m2": ("fp32, fp8 e5m2", "fp32", {"strategy": "fp8_compress", "fp8_format": "e5m2"}),
    "fp32-fp8-e5m2-ef": ("fp32, fp8 e5m2 + EF", "fp32", {"strategy": "fp8_compress", "fp8_format": "e5m2",
                                                         "error_feedback": True}),
    "fp32-int8": ("fp32, int8", "fp32", {"strategy": "int8_compress"}),
    "fp32-int8-ef": ("fp32, int8 + EF", "fp32", {"strategy": "int8_compress", "error_feedback": True}),
    "fp32-topk-0.01": ("fp32, top-k 1%", "fp32", {"strategy": "topk", "topk_ratio": 0.01}),
    "fp32-topk-0.001": ("fp32, top-k 0.1%", "fp32", {"strategy": "topk", "topk_ratio": 0.001}),
    # fp32 masters sharded by FSDP2 (mpfp16.distributed.shard): reduce-scatter and all-gathers, no allreduce
    "fp16-sharded": ("fp16, sharded (FSDP2)", "fp16", {"shard": True}),
}
DEFAULT_SETUPS = ("fp32", "fp16", "fp16-fp32-allreduce", "fp16-fp32-accumulate")
WIRE_SETUPS = tuple(k for k, (_, _, kw) in SETUPS.items()
                    if kw.get("strategy") in ("fp8_compress", "int8_compress", "topk"))
MOMENTUM = 0.9  # the step view's SGD momentum; under top-k, the exchange's (DGC's momentum correction)
MODES = ("single", "sync", "no_sync")  # 1 process; an allreduce every micro-batch; no_sync but the last


def model_names() -> list[str]:
    from ..train.models import imagenet_arch_names

    return list(GPT_SIZES) + imagenet_arch_names()


def _workload(args, rank: int, device: torch.device):
    """(build(), loss(net)): the model's constructor and its loss on this rank's fixed
    micro-batch, random with a per-rank seed. A GPT size keeps all its positions (its
    parameters, the allreduce volume, are the named size's) and trains on ``--seq-len``
    random token ids with the next-token loss; a torchvision model on random images."""
    g = torch.Generator().manual_seed(rank)
    if args.model in GPT_SIZES:
        tokens = torch.randint(0, GPT_SIZES[args.model]["vocab_size"], (args.batch_size, args.seq_len + 1),
                               generator=g).to(device)
        return (lambda: build_gpt(args.model)), (lambda net: next_token_loss(net, tokens))
    import torchvision

    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    return ((lambda: torchvision.models.get_model(args.model, weights=None, num_classes=10)),
            (lambda net: nn.functional.cross_entropy(net(images), labels)))


def _build(make_model, precision: str, device: torch.device, init_scale: float = 2.0**16, shard: bool = False,
           accumulate_dtype: torch.dtype | None = None, momentum: float = MOMENTUM):
    from ..convert import to_half
    from ..optimizer import FP16Optimizer
    from ..scaler import DynamicLossScaler

    torch.manual_seed(0)
    model = make_model().to(device)
    if shard:
        model = mdist.shard(model)
    elif precision == "fp16":
        to_half(model)
    scaler = DynamicLossScaler(init_scale=init_scale) if precision == "fp16" else None
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=momentum), loss_scale=scaler,
                        model=model if shard else None, accumulate_dtype=accumulate_dtype)
    return model, opt


def _comm_row(per_step: list[dict]) -> dict:
    """The step view's communication columns, medians over the steps. A sharded model's
    are its reduce-scatters and all-gathers together, and each kind on its own."""
    def median(key):
        return statistics.median(s[key] for s in per_step)

    if "reduce_scatter_bytes" not in per_step[0]:
        comm = [1e3 * s["allreduce_time_s"] for s in per_step]
        exposed = [1e3 * s["allreduce_wait_s"] for s in per_step]
        return {"bytes_per_step": median("allreduce_bytes"), "calls_per_step": median("allreduce_calls"),
                "comm_ms": statistics.median(comm), "comm_ms_min": min(comm), "comm_ms_max": max(comm),
                "exposed_ms": statistics.median(exposed), "exposed_ms_min": min(exposed),
                "exposed_ms_max": max(exposed)}
    # Sharded: the all-gathers run through forward and backward, so the time counted is
    # each collective's own, launch to result, summed; exposed: the reduce-scatters'
    # time after backward's last one was launched.
    kinds = ("reduce_scatter", "all_gather")
    row = {"bytes_per_step": sum(median(f"{k}_bytes") for k in kinds),
           "calls_per_step": sum(median(f"{k}_calls") for k in kinds),
           "comm_ms": 1e3 * sum(median(f"{k}_busy_s") for k in kinds),
           "exposed_ms": 1e3 * median("reduce_scatter_wait_s")}
    for k in kinds:
        row[f"{k}_bytes"] = median(f"{k}_bytes")
        row[f"{k}_ms"] = 1e3 * median(f"{k}_busy_s")
    return row


def _steps(net, opt, loss, accum: int, steps: int, sync_every_micro: bool, stats,
           durations: list | None = None) -> tuple[float, list[dict]]:
    """Run `steps` optimizer steps of `accum` micro-batches; return seconds and per-step
    comm figures (and append each step's seconds to ``durations``)."""
    per_step = []
    start = time.perf_counter()
    for _ in range(steps):
        began = time.perf_counter()
        opt.zero_grad()
        for micro in range(accum):
            with mdist.sync_gradients(net, sync_every_micro or micro == accum - 1):
                opt.backward(loss(net) / accum)
        opt.step()
        if durations is not None:
            durations.append(time.perf_counter() - began)
        if stats is not None:
            per_step.append(stats.pop_step())
    return time.perf_counter() - start, per_step


def _warm_up(net, opt, loss, accum: int, sync_every_micro: bool, stats) -> None:
    """At least 2 steps (PowerSGD runs a plain allreduce on its first backward pass,
    the fused step compiles at its first), then steps until one is not skipped, at
    most 25: the dynamic loss scale backs off from its initial 2^16 (by half per
    skipped step) until the gradients fit, so that the timed steps are real steps,
    not skips."""
    for i in range(25):
        skipped = opt.skipped_steps
        _steps(net, opt, loss, accum, 1, sync_every_micro, stats)
        if opt.skipped_steps == skipped and i >= 1:
            return
    print(f"warning: every warm-up step was skipped (loss scale now {opt.loss_scale:g}); the timed steps may be "
          "skips too", file=sys.stderr)


def model_view(args, info: mdist.DistInfo, wire: WireCounter | None = None) -> list[dict]:
    device, world = info.device, info.world_size
    make_model, loss = _workload(args, info.rank, device)
    accumulate_dtype = ACCUMULATE_DTYPES[args.accumulate_dtype]
    rows = []
    for key in args.setups:
        name, precision, wrap_kw = SETUPS[key]
        if wrap_kw.get("strategy") == "topk":  # DGC: the momentum moves from SGD into the exchange
            wrap_kw, momentum = {**wrap_kw, "topk_momentum": MOMENTUM}, 0.0
        else:
            momentum = MOMENTUM
        micro = args.accum * args.steps
        # One process: rank 0 alone (its overflow decisions must not wait for the
        # others), while the other ranks wait at the broadcast. Its loss scale is the
        # other modes' starting point, so it warms up even when its row is not asked for.
        single = torch.zeros(2, dtype=torch.float64, device=device)  # rate, the loss scale it settled on
        if info.rank == 0 and ("single" in args.modes or precision == "fp16"):
            model, opt = _build(make_model, precision, device, accumulate_dtype=accumulate_dtype, momentum=momentum)
            opt.reduce_overflow = False
            _warm_up(model, opt, loss, args.accum, True, None)
            if "single" in args.modes:
                seconds, _ = _steps(model, opt, loss, args.accum, args.steps, True, None)
                single[0] = micro / seconds
            single[1] = opt.loss_scale
            del model, opt
        dist.broadcast(single, src=0)
        # The same on every rank, starting from the settled scale.
        sharded = wrap_kw.get("shard", False)
        model, opt = _build(make_model, precision, device, init_scale=float(single[1]), shard=sharded,
                            accumulate_dtype=accumulate_dtype, momentum=momentum)
        ddp = model if sharded else mdist.wrap(model, bucket_mb=args.bucket_mb, **wrap_kw)
        stats = mdist.comm_stats(ddp)
        if "single" in args.modes:
            rows.append({"setup": name, "key": key, "processes": 1, "no_sync": None, "its_per_s": float(single[0]),
                         "bytes_per_step": 0, "calls_per_step": 0, "comm_ms": 0.0, "exposed_ms": 0.0,
                         "skipped": None})
        for no_sync in [mode == "no_sync" for mode in args.modes if mode != "single"]:
            _warm_up(ddp, opt, loss, args.accum, not no_sync, stats)
            dist.barrier()
            skipped = opt.skipped_steps
            before = wire.read() if wire is not None else 0
            durations: list[float] = []
            seconds, per_step = _steps(ddp, opt, loss, args.accum, args.steps, not no_sync, stats, durations)
            dist.barrier()  # the peer has received everything: nothing sent still waits in a queue uncounted
            sent = wire.read() - before if wire is not None else 0
            rate = over_ranks(micro / seconds, device, dist.ReduceOp.MIN)  # the slowest rank sets the pace
            step_s = {f"step_s{suffix}": over_ranks(f(durations), device)  # the slowest rank's
                      for suffix, f in (("_min", min), ("_median", statistics.median), ("_max", max))}
            row = {"setup": name, "key": key, "processes": world, "no_sync": no_sync, "its_per_s": rate,
                   **step_s, **_comm_row(per_step), "skipped": opt.skipped_steps - skipped}
            if wire is not None:  # everything this node sent during the timed steps, per step
                row["wire_bytes_per_step"] = over_ranks(sent / args.steps, device)
            rows.append(row)
        del ddp, model, opt
    return rows


def _sharded_columns(r: dict) -> str:
    if "reduce_scatter_bytes" not in r:
        return f"{'-':>8}" * 4
    return (f"{r['reduce_scatter_bytes'] / 1e6:>8.2f}{r['reduce_scatter_ms']:>8.1f}"
            f"{r['all_gather_bytes'] / 1e6:>8.2f}{r['all_gather_ms']:>8.1f}")


def step_ratios(rows: list[dict], key: str) -> list[float | None]:
    """Each step-view row's ``key`` over the ``fp32`` set-up's row of the same run with
    the same processes and no_sync, and on the same link (``rate_gbps``, where rows of
    several link rates are together: mpfp16.bench.netem); None without one, or for a
    1-process row."""
    group = ("processes", "no_sync", "rate_gbps")
    return [None if r["processes"] < 2 else v for r, v in zip(rows, fp32_ratios(rows, key, group, name="key"))]


def model_table(rows: list[dict]) -> str:
    """One line per row; the step time's min, median and max over the timed steps, and
    the bytes, communication in flight and exposed communication over the fp32
    model's (``x fp32``, the same run's); ``wire MB`` (what the busiest node sent on
    its interface per step) when the rows were measured with ``--wire-iface``; for
    sharded rows, the reduce-scatter (RS) and all-gather (AG) payloads and in-flight
    times apart."""
    wired = any("wire_bytes_per_step" in r for r in rows)
    sharded = any("reduce_scatter_bytes" in r for r in rows)
    ratios = {k: step_ratios(rows, k) for k in ("bytes_per_step", "comm_ms", "exposed_ms")}
    lines = [f"{'setup':<26}{'procs':>6}{'no_sync':>9}{'it/s/rank':>11}{'step s min-med-max':>21}{'MB/step':>10}"
             f"{'x fp32':>8}{'calls':>7}{'comm_ms':>9}{'x fp32':>8}{'exposed_ms':>11}{'x fp32':>8}{'skipped':>9}"
             + (f"{'wire MB':>9}" if wired else "")
             + (f"{'RS MB':>8}{'RS ms':>8}{'AG MB':>8}{'AG ms':>8}" if sharded else "")]
    for i, r in enumerate(rows):
        ns = "-" if r["no_sync"] is None else ("yes" if r["no_sync"] else "no")
        skipped = "-" if r["skipped"] is None else str(r["skipped"])
        wire = r.get("wire_bytes_per_step")
        spread = (f"{r['step_s_min']:.3f}-{r['step_s_median']:.3f}-{r['step_s_max']:.3f}" if "step_s_median" in r
                  else "-")
        lines.append(f"{r['setup']:<26}{r['processes']:>6}{ns:>9}{r['its_per_s']:>11.2f}{spread:>21}"
                     f"{r['bytes_per_step'] / 1e6:>10.2f}{_ratio(ratios['bytes_per_step'][i], 8, 3)}"
                     f"{r['calls_per_step']:>7.0f}{r['comm_ms']:>9.1f}{_ratio(ratios['comm_ms'][i], 8)}"
                     f"{r['exposed_ms']:>11.1f}{_ratio(ratios['exposed_ms'][i], 8)}{skipped:>9}"
                     + ((f"{wire / 1e6:>9.2f}" if wire is not None else f"{'-':>9}") if wired else "")
                     + (_sharded_columns(r) if sharded else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda t: [parse_size(s) for s in t.split(",")],
                   default="4K,64K,1M,4M,16M,64M,128M",
                   help="fp32 message sizes, K/M/G binary suffixes (default: 4K,64K,1M,4M,16M,64M,128M)")
    p.add_argument("--dtypes", type=parse_list(list(DTYPES)), default="fp32,fp16,bf16",
                   help="types to compare (default: fp32,fp16,bf16)")
    p.add_argument("--strategies", type=parse_list(list(hooks.MPFP16_STRATEGIES)), default="allreduce,fp32_accumulate",
                   help="16-bit strategies (default: allreduce,fp32_accumulate)")
    p.add_argument("--wires", type=parse_list(list(WIRES), allow_none=True), default=",".join(WIRES),
                   help=(f"mpfp16's 8-bit and top-k exchanges beside them, or none (default: {','.join(WIRES)}; "
                         "+ef: with error feedback)").replace("%", "%%"))
    p.add_argument("--iters", type=int, default=10, help="timed rounds (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON (default: none)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="plot busbw against size (default: none)")
    g = p.add_argument_group("training-step view")
    g.add_argument("--model", default=None, help="measure this model's training steps instead of the sweep: "
                                                 "a GPT size (imagegpt-s, gpt2) or a torchvision model (default: none)")
    g.add_argument("--setups", type=parse_list(list(SETUPS)), default=",".join(DEFAULT_SETUPS),
                   help=f"which set-ups, in order, of {', '.join(SETUPS)} (default: {','.join(DEFAULT_SETUPS)})")
    g.add_argument("--modes", type=parse_list(list(MODES)), default=",".join(MODES),
                   help="single: 1 process; sync: an allreduce every micro-batch; no_sync: on the last only "
                        f"(default: {','.join(MODES)})")
    g.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step (default: 4)")
    g.add_argument("--steps", type=int, default=3, help="timed optimizer steps per set-up (default: 3)")
    g.add_argument("--batch-size", type=int, default=8, help="images or sequences per micro-batch (default: 8)")
    g.add_argument("--image-size", type=int, default=64, help="image side, torchvision models (default: 64)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, GPT sizes (default: 64)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (default: 25)")
    g.add_argument("--accumulate-dtype", choices=[k for k in ACCUMULATE_DTYPES if k], default=None,
                   help="FP16Optimizer(accumulate_dtype=torch.float32): sum the micro-batches' 16-bit gradients "
                        "in fp32, the step's exchanges carrying the sum (not with fp16-sharded; default: the "
                        "parameters' dtype, as apex)")
    p.add_argument("--wire-iface", default=None, metavar="IFACE",
                   help="also count the bytes this node sends on network interface IFACE (sysfs counters), "
                        "as mpfp16.bench.netem does on its emulated link (default: none)")
    p.add_argument("--dist-backend", choices=mdist.BACKENDS, default=None,
                   help="process group backend (default: nccl on GPU, gloo on CPU)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "accum", "steps", "batch_size", "image_size", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.model is not None and args.model not in model_names():
        parser.error(f"unknown model {args.model!r}: a GPT size (imagegpt-s, gpt2) or a torchvision model")
    if args.model is not None:
        if args.model in GPT_SIZES and args.seq_len > GPT_SIZES[args.model]["seq_len"]:
            parser.error(f"--seq-len {args.seq_len}: {args.model} has {GPT_SIZES[args.model]['seq_len']} positions")
    if args.accumulate_dtype is not None and "fp16-sharded" in args.setups:
        parser.error("--accumulate-dtype fp32 is not possible with the fp16-sharded set-up: FSDP2 sums the "
                     "micro-batches' gradients in its reduce_dtype; drop one of them")
    try:
        wire = WireCounter(args.wire_iface) if args.wire_iface else None
    except LinkError as exc:
        parser.error(str(exc))
    info = mdist.init(backend=args.dist_backend)
    if not info.distributed or info.world_size < 2:
        print("error: run this under torchrun with 2 or more processes, e.g. "
              "torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce", file=sys.stderr)
        mdist.teardown()
        return 2
    try:
        header = f"# {info.world_size} ranks, backend {info.backend}, device {info.device.type}"
        if args.model is None:
            rows = sweep(args.sizes, args.dtypes, args.strategies, args.iters, args.warmup, info.device, wire,
                         args.wires)
            text = sweep_table(rows)
            header += (f", median (min, max) of {args.iters} rounds (slowest rank), count = size / 4 for every "
                       "type; vs fp32: time over fp32's, bytes vs fp32: one rank's message over fp32's")
        else:
            rows = model_view(args, info, wire)
            text = model_table(rows)
            shape = f"{args.seq_len} tokens" if args.model in GPT_SIZES else f"{args.image_size}px"
            header += (f", {args.model}, batch {args.batch_size} at {shape}, "
                       f"{args.accum} micro-batches per step, median of {args.steps} steps; x fp32: over the "
                       "fp32 model's row")
            if args.accumulate_dtype is not None:
                header += f", accumulate_dtype {args.accumulate_dtype}"
        if info.is_main_process:
            print(header)
            print(text)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"world_size": info.world_size, "backend": info.backend, "rows": rows,
                               "accumulate_dtype": args.accumulate_dtype}, f, indent=1)
            if args.plot and args.model is None:
                plot_sweep(rows, args.plot, f"allreduce, {info.world_size} ranks, {info.backend}")
    finally:
        mdist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
