"""The bandwidth study: fp16 vs fp32 gradient allreduce, from one collective to a training step.

Run under torchrun (gloo on CPU, NCCL on GPU):

    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --sizes 4K,1M,16M,100M --json sweep.json --plot sweep.png
    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --model resnet18 --accum 4
    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --model imagegpt-s --seq-len 16 --batch-size 1 --accum 32

Collective sweep (default). For each size, every type averages the same number of
elements, count = size / 4: the fp32 message is ``size`` bytes and a 16-bit one half
of it. Types: ``fp32``, ``fp16``, ``bf16`` (one ``all_reduce`` each) and, with
``--strategies`` including ``fp32_accumulate``, ``fp16+acc32`` and ``bf16+acc32``
(mpfp16's 16-bit wire with fp32 sums). The types run alternately, one iteration
each per round, after ``--warmup`` rounds; each iteration is timed between barriers
and the slowest rank's time counts; the table gives the median. As in nccl-tests
(doc/PERFORMANCE.md): algbw = bytes / time; busbw = algbw * 2(n-1)/n for an
allreduce, the rate each rank's link must sustain, comparable across world sizes.

Training-step view (``--model``). The gradients of a real model (a torchvision model
on random images, or a GPT size from mpfp16.train.gpt on random tokens), synced
by DDP with mpfp16's hooks, in up to four set-ups (``--setups``): an fp32 model; an
fp16 model with the fp16 allreduce; fp16 with an fp32 allreduce; fp16 with the
fp32-accumulate strategy; and, with ``fp16-sharded``, fp32 masters sharded by FSDP2
(:func:`mpfp16.distributed.shard`), whose gradient reduce-scatters and parameter
all-gathers replace the allreduce (its one-process row is the unsharded fp16 model).
The optimizer is SGD with momentum; ``--accumulate-dtype fp32`` builds it with
``accumulate_dtype=torch.float32`` (the micro-batches' gradients summed in fp32, the
step's exchanges carrying the sum: the same bytes on the wire).
Each runs ``--accum`` micro-batches per optimizer step, once with an allreduce on
every micro-batch and once with ``no_sync`` on all but the last; a one-process
baseline (rank 0 alone, the others idle) gives the compute-only rate. The table
reports per-rank micro-batches per second, bytes and allreduce calls per optimizer
step, the time communication was in flight, and the part of it backward did not
hide (exposed).
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
from .. import distributed as mdist
from ..train.gpt import GPT_SIZES, build_gpt, next_token_loss
from .links import LinkError, WireCounter
from .timing import time_call

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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


def parse_list(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}")
        return items
    return parse


def busbw_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor, 2(n-1)/n: a ring allreduce moves
    each byte over 2(n-1) links while n ranks share the work."""
    return 2.0 * (world_size - 1) / world_size


def bandwidths(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second)."""
    algbw = size_bytes / seconds / 1e9
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


def sweep_methods(count: int, dtypes: list[str], strategies: list[str], device: torch.device) -> dict:
    """type name -> (function averaging `count` elements, wire dtype)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    base = torch.randn(count, generator=g).to(device)
    state = hooks.HookState()
    methods = {}
    for name in dtypes:
        buf = base.to(DTYPES[name])
        if "allreduce" in strategies or name == "fp32":
            methods[name] = ((lambda b: lambda: dist.all_reduce(b))(buf), DTYPES[name])
        if "fp32_accumulate" in strategies and name != "fp32":
            methods[f"{name}+acc32"] = ((lambda b: lambda: hooks.average_fp32_accumulate(state, b))(buf.clone()),
                                        DTYPES[name])
    return methods


def sweep(sizes: list[int], dtypes: list[str], strategies: list[str], iters: int, warmup: int,
          device: torch.device, wire: WireCounter | None = None) -> list[dict]:
    """The sweep's rows. With ``wire``, each row also has ``wire_bytes``: the bytes the
    busiest node sent on its interface per call (median), headers and the timing's
    barrier and all-reduce of one number (a few hundred bytes) included."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        count = size // 4
        methods = sweep_methods(count, dtypes, strategies, device)
        times = {name: [] for name in methods}
        sent = {name: [] for name in methods}
        for i in range(warmup + iters):
            for name, (fn, _) in methods.items():
                before = wire.read() if wire is not None else 0
                t = timed(fn, device)
                if wire is not None:
                    # read after timed()'s closing all-reduce: by then the peer has received
                    # everything, so nothing of this call still waits in the qdisc uncounted
                    sent[name].append(wire.read() - before)
                if i >= warmup:
                    times[name].append(t)
        for name, (_, wire_dtype) in methods.items():
            seconds = statistics.median(times[name])
            nbytes = count * wire_dtype.itemsize
            algbw, busbw = bandwidths(nbytes, seconds, world)
            row = {"size_bytes": nbytes, "count": count, "dtype": name, "time_us": seconds * 1e6,
                   "algbw_gbps": algbw, "busbw_gbps": busbw}
            if wire is not None:
                row["wire_bytes"] = over_ranks(statistics.median(sent[name][warmup:]), device)
            rows.append(row)
        del methods
    return rows


def sweep_table(rows: list[dict]) -> str:
    """nccl-tests-like table, then each type's time relative to fp32 at equal count."""
    wired = any("wire_bytes" in r for r in rows)
    lines = [f"{'size':>12} {'count':>12} {'type':>10} {'time_us':>11} {'algbw':>8} {'busbw':>8}   {'vs fp32':>7}"
             + (f" {'wire_bytes':>12}" if wired else "")]
    fp32 = {r["count"]: r["time_us"] for r in rows if r["dtype"] == "fp32"}
    for r in rows:
        ratio = f"{r['time_us'] / fp32[r['count']]:7.2f}" if r["count"] in fp32 else "      -"
        lines.append(f"{r['size_bytes']:>12} {r['count']:>12} {r['dtype']:>10} {r['time_us']:>11.1f} "
                     f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f}   {ratio}"
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
    for i, name in enumerate(dict.fromkeys(r["dtype"] for r in rows)):
        mine = [r for r in rows if r["dtype"] == name]
        style = {"marker": "o", "label": name, "color": f"C{i}"}
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
    right.set_xlabel("elements")
    right.set_ylabel("time / fp32 time, same elements")
    right.set_title("16-bit vs fp32 (dotted: half the bytes)")
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
    # fp32 masters sharded by FSDP2 (mpfp16.distributed.shard): reduce-scatter and all-gathers, no allreduce
    "fp16-sharded": ("fp16, sharded (FSDP2)", "fp16", {"shard": True}),
}
DEFAULT_SETUPS = ("fp32", "fp16", "fp16-fp32-allreduce", "fp16-fp32-accumulate")
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
           accumulate_dtype: torch.dtype | None = None):
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
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), loss_scale=scaler,
                        model=model if shard else None, accumulate_dtype=accumulate_dtype)
    return model, opt


def _comm_row(per_step: list[dict]) -> dict:
    """The step view's communication columns, medians over the steps. A sharded model's
    are its reduce-scatters and all-gathers together, and each kind on its own."""
    def median(key):
        return statistics.median(s[key] for s in per_step)

    if "reduce_scatter_bytes" not in per_step[0]:
        return {"bytes_per_step": median("allreduce_bytes"), "calls_per_step": median("allreduce_calls"),
                "comm_ms": 1e3 * median("allreduce_time_s"), "exposed_ms": 1e3 * median("allreduce_wait_s")}
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


def _steps(net, opt, loss, accum: int, steps: int, sync_every_micro: bool, stats) -> tuple[float, list[dict]]:
    """Run `steps` optimizer steps of `accum` micro-batches; return seconds and per-step comm figures."""
    per_step = []
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            with mdist.sync_gradients(net, sync_every_micro or micro == accum - 1):
                opt.backward(loss(net) / accum)
        opt.step()
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
        micro = args.accum * args.steps
        # One process: rank 0 alone (its overflow decisions must not wait for the
        # others), while the other ranks wait at the broadcast. Its loss scale is the
        # other modes' starting point, so it warms up even when its row is not asked for.
        single = torch.zeros(2, dtype=torch.float64, device=device)  # rate, the loss scale it settled on
        if info.rank == 0 and ("single" in args.modes or precision == "fp16"):
            model, opt = _build(make_model, precision, device, accumulate_dtype=accumulate_dtype)
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
                            accumulate_dtype=accumulate_dtype)
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
            seconds, per_step = _steps(ddp, opt, loss, args.accum, args.steps, not no_sync, stats)
            dist.barrier()  # the peer has received everything: nothing sent still waits in a queue uncounted
            sent = wire.read() - before if wire is not None else 0
            rate = over_ranks(micro / seconds, device, dist.ReduceOp.MIN)  # the slowest rank sets the pace
            row = {"setup": name, "key": key, "processes": world, "no_sync": no_sync, "its_per_s": rate,
                   **_comm_row(per_step), "skipped": opt.skipped_steps - skipped}
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


def model_table(rows: list[dict]) -> str:
    """One line per row; ``wire MB`` (what the busiest node sent on its interface per
    step) when the rows were measured with ``--wire-iface``; for sharded rows, the
    reduce-scatter (RS) and all-gather (AG) payloads and in-flight times apart."""
    wired = any("wire_bytes_per_step" in r for r in rows)
    sharded = any("reduce_scatter_bytes" in r for r in rows)
    lines = [f"{'setup':<26}{'procs':>6}{'no_sync':>9}{'it/s/rank':>11}{'MB/step':>10}{'calls':>7}"
             f"{'comm_ms':>9}{'exposed_ms':>11}{'skipped':>9}" + (f"{'wire MB':>9}" if wired else "")
             + (f"{'RS MB':>8}{'RS ms':>8}{'AG MB':>8}{'AG ms':>8}" if sharded else "")]
    for r in rows:
        ns = "-" if r["no_sync"] is None else ("yes" if r["no_sync"] else "no")
        skipped = "-" if r["skipped"] is None else str(r["skipped"])
        wire = r.get("wire_bytes_per_step")
        lines.append(f"{r['setup']:<26}{r['processes']:>6}{ns:>9}{r['its_per_s']:>11.2f}"
                     f"{r['bytes_per_step'] / 1e6:>10.2f}{r['calls_per_step']:>7.0f}{r['comm_ms']:>9.1f}"
                     f"{r['exposed_ms']:>11.1f}{skipped:>9}"
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
            rows = sweep(args.sizes, args.dtypes, args.strategies, args.iters, args.warmup, info.device, wire)
            text = sweep_table(rows)
            header += f", median of {args.iters} rounds (slowest rank), count = size / 4 for every type"
        else:
            rows = model_view(args, info, wire)
            text = model_table(rows)
            shape = f"{args.seq_len} tokens" if args.model in GPT_SIZES else f"{args.image_size}px"
            header += (f", {args.model}, batch {args.batch_size} at {shape}, "
                       f"{args.accum} micro-batches per step, median of {args.steps} steps")
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
