"""Gradient-sync benchmark: fp32 vs 16-bit allreduce, and mpfp16's fp32-accumulate strategy.

Run under torchrun (gloo on CPU, NCCL on GPU):

    torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce --numel 25M

Every method averages the same number of gradient elements. The methods run
alternately, one iteration each per round, so that drift of a shared machine hits
them all alike; each iteration is timed between barriers and the slowest rank's time
counts. The table gives medians and each method's ratio to the fp32 allreduce.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .. import comm
from .. import distributed as mdist

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """'25M' -> 26214400, '4K' -> 4096, '1000' -> 1000 (binary suffixes, as nccl-tests)."""
    text = text.strip().upper()
    mult = SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SUFFIXES else text
    try:
        value = float(digits) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (use e.g. 4096, 64K, 25M)") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole count: {text!r}")
    return int(value)


def timed(fn, device: torch.device) -> float:
    """Seconds for one call of ``fn``, between barriers; the slowest rank's."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def strategy_methods(numel: int, device: torch.device) -> dict:
    """name -> (callable that averages `numel` gradient elements, its wire dtype)."""
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    base = torch.randn(numel, generator=g).to(device)
    bufs = {dt: base.to(dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}
    world = dist.get_world_size()
    state = comm.HookState()

    def allreduce(dtype):
        def run():
            dist.all_reduce(bufs[dtype])
            bufs[dtype].div_(world)
        return run

    return {
        "fp32 allreduce": (allreduce(torch.float32), torch.float32),
        "fp16 allreduce": (allreduce(torch.float16), torch.float16),
        "bf16 allreduce": (allreduce(torch.bfloat16), torch.bfloat16),
        "fp16 fp32-accumulate": (lambda: comm._fp32_accumulate(state, bufs[torch.float16]), torch.float16),
    }


def compare(methods: dict, iters: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    times = {name: [] for name in methods}
    for i in range(warmup + iters):
        for name, (fn, _) in methods.items():
            t = timed(fn, device)
            if i >= warmup:
                times[name].append(t)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=parse_count, default=parse_count("25M"),
                        help="gradient elements to average (default: 25M)")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    parser.add_argument("--dist-backend", choices=mdist.BACKENDS, default=None,
                        help="process group backend (default: nccl on GPU, gloo on CPU)")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    info = mdist.init(backend=args.dist_backend)
    if not info.distributed:
        print("error: run this under torchrun, e.g. torchrun --nproc_per_node 2 -m mpfp16.bench.allreduce",
              file=sys.stderr)
        return 2
    try:
        methods = strategy_methods(args.numel, info.device)
        times = compare(methods, args.iters, args.warmup, info.device)
        if info.is_main_process:
            print(f"# {info.world_size} ranks, backend {info.backend}, {args.numel:,} elements, "
                  f"median of {args.iters} rounds (slowest rank)")
            ref = statistics.median(times["fp32 allreduce"])
            print(f"{'method':<24}{'wire':>10}{'time_ms':>10}{'vs fp32':>9}")
            for name, (_, wire) in methods.items():
                t = statistics.median(times[name])
                print(f"{name:<24}{comm.dtype_name(wire):>10}{t * 1e3:>10.1f}{t / ref:>9.2f}")
    finally:
        mdist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
