"""What checking the replicas costs: mpfp16's check against Megatron-LM's way, beside the
optimizer step it runs between.

    python -m mpfp16.bench.replicas [--model resnet50] [--rounds 7] [--json PATH]
    torchrun --nproc_per_node 2 -m mpfp16.bench.replicas     # with the collective

The state is that of an fp16 model with the shapes of a torchvision model (ResNet-50:
25.6M parameters in 161 tensors) stepped by FP16Optimizer over SGD with momentum:
fp16 weights, fp32 masters, fp32 momentum. Timed alternately, one call each per
round, medians:

  a. the optimizer step (FP16Optimizer, unfused): the scale of comparison;
  b. mpfp16: ``check_replicas(model, opt)`` under torchrun; in one process, its local
     part (the checksums of the weights, masters, optimizer state and counters);
  c. Megatron-LM's ``check_param_hashes_across_dp_replicas`` way: copy each parameter
     to the host and SHA-256 it (and ``all_gather_object`` the digests under
     torchrun). It covers the 16-bit weights only: less state than b.

For each: milliseconds, the bytes it reads, GB/s, its ratio to the step, and its
share of training time at ``--check-replicas 100`` if a training step took no more
than its optimizer step (an upper bound: forward and backward make real steps
longer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import distributed as mdist
from ..parallel.replicas import check_replicas, collect, local_summary
from .step import _Mpfp16, cpu_model, model_params
from .timing import time_call

INTERVAL = 100  # the scripts' default --check-replicas


def megatron_style(params: list[torch.Tensor]):
    """Host copies and SHA-256 digests of every parameter, gathered across ranks."""

    def check():
        digests = [hashlib.sha256(p.detach().view(torch.int16).cpu().numpy().tobytes()).digest() for p in params]
        if mdist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, digests)
            if any(g != digests for g in gathered):
                raise RuntimeError("replicas differ")

    return check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="torchvision model whose shapes to use (default: resnet50)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default: 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    info = mdist.init(log_level=30)
    device = info.device
    try:
        holder = _Mpfp16("sgd", model_params(args.model, device), fused=False)
        model = nn.ParameterList(holder.params)
        holder._touch()
        holder.step()  # momentum buffers exist from here on
        tensors, values, _ = collect(model, holder.opt)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        param_bytes = sum(p.numel() * p.element_size() for p in holder.params)

        if info.distributed:
            ours = ("b. mpfp16 check_replicas", lambda: check_replicas(model, holder.opt))
        else:
            ours = ("b. mpfp16 checksums (local)", lambda: local_summary(*collect(model, holder.opt)[:2])[0].tolist())
        methods = {
            "a. optimizer step": (holder._touch, holder.step),
            ours[0]: (None, ours[1]),
            "c. Megatron-style SHA-256": (None, megatron_style(holder.params)),
        }
        read = {"a. optimizer step": None, ours[0]: nbytes, "c. Megatron-style SHA-256": param_bytes}
        times = {name: [] for name in methods}
        for i in range(args.warmup + args.rounds):
            for name, (prepare, call) in methods.items():
                if prepare is not None:
                    prepare()
                seconds = time_call(call, device)
                if i >= args.warmup:
                    times[name].append(seconds)
    finally:
        mdist.teardown()
    step = statistics.median(times["a. optimizer step"])
    rows = []
    if info.is_main_process:
        where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
        print(f"# {args.model} shapes: {sum(p.numel() for p in holder.params):,} parameters in "
              f"{len(holder.params)} tensors, fp16 + fp32 masters + SGD momentum; {len(tensors)} tensors "
              f"({nbytes / 1e6:.0f} MB) checked; {info.world_size} process(es); {device.type} ({where}); "
              f"{torch.get_num_threads()} threads; median of {args.rounds} rounds")
        print(f"{'method':<32}{'ms':>9}{'MB read':>9}{'GB/s':>7}{'vs a':>7}{f'share at {INTERVAL}':>14}")
    for name, ts in times.items():
        t = statistics.median(ts)
        row = {"method": name, "median_ms": t * 1e3, "ratio_to_step": t / step,
               "bytes": read[name], "gb_per_s": read[name] / t / 1e9 if read[name] else None,
               "share_at_interval": t / (t + INTERVAL * step) if read[name] else None}
        rows.append(row)
        if info.is_main_process:
            mb = f"{read[name] / 1e6:.0f}" if read[name] else "-"
            gbs = f"{row['gb_per_s']:.1f}" if read[name] else "-"
            share = f"{100 * row['share_at_interval']:.2f}%" if read[name] else "-"
            print(f"{name:<32}{t * 1e3:>9.2f}{mb:>9}{gbs:>7}{t / step:>7.2f}{share:>14}")
    if args.json and info.is_main_process:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "world_size": info.world_size, "device": device.type,
                       "threads": torch.get_num_threads(), "tensors": len(tensors), "bytes": nbytes,
                       "interval": INTERVAL, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
