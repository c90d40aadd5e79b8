"""What the checkpoints' per-tensor checksums cost: a save and a load with them and
without, side by side in one run.

    python -m mpfp16.bench.checksum [--model resnet50] [--rounds 5] [--dir DIR] [--json PATH]

The state is a training checkpoint of an fp16 model with the shapes of a torchvision
model (ResNet-50: 25.6M parameters) stepped by FP16Optimizer over SGD with momentum:
fp16 weights, fp32 masters and fp32 momentum, about 256 MB. It is written with
:func:`mpfp16.checkpoint.file.save_atomic` (atomic: a temporary file, fsync, rename)
with and without checksums, and read back with :func:`mpfp16.checkpoint.file.load`
with and without verifying them; the four are timed alternately, one call each per
round, medians. The checksum alone (:func:`mpfp16.checkpoint.integrity.checksums`) is
timed too. Ratios are "with / without". The file is written to ``--dir`` (default: a
temporary folder), so the numbers include that disk and the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

from ..checkpoint import FORMAT, file, integrity
from .step import _Mpfp16, cpu_model, model_params


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="torchvision model whose shapes to use (default: resnet50)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    holder = _Mpfp16("sgd", model_params(args.model, torch.device("cpu")), fused=False)
    holder._touch()
    holder.step()  # momentum buffers exist from here on
    state = {"format": FORMAT, "model": nn.ParameterList(holder.params).state_dict(),
             "optimizer": holder.opt.state_dict(), "step": 1}
    found: list = []
    integrity._walk(state, (), found)
    nbytes = sum(t.numel() * t.element_size() for _, t in found)
    folder = args.dir or tempfile.mkdtemp(prefix="mpfp16-checksum-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "last.pt")
    with_sums, without = os.path.join(folder, "with.pt"), os.path.join(folder, "without.pt")
    methods = {
        "checksums alone": lambda: integrity.checksums(state),
        "save, with checksums": lambda: file.save_atomic(state, with_sums),
        "save, without": lambda: file.save_atomic(state, without, checksum=False),
        "load, verified": lambda: file.load(with_sums),
        "load, not verified": lambda: file.load(without, verify=False),
    }
    times = {name: [] for name in methods}
    try:
        for i in range(args.warmup + args.rounds):
            for name, call in methods.items():
                seconds = _timed(call)
                if i >= args.warmup:
                    times[name].append(seconds)
        file_bytes = os.path.getsize(with_sums)
    finally:
        for p in (path, with_sums, without):
            if os.path.exists(p):
                os.unlink(p)
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {"save": median["save, with checksums"] / median["save, without"],
              "load": median["load, verified"] / median["load, not verified"]}
    print(f"# {args.model} shapes: {sum(p.numel() for p in holder.params):,} parameters; {len(found)} tensors "
          f"({nbytes / 1e6:.0f} MB: fp16 weights, fp32 masters, SGD momentum); a {file_bytes / 1e6:.0f} MB file; "
          f"cpu ({cpu_model()}), {torch.get_num_threads()} threads; median of {args.rounds} rounds")
    print(f"{'':<24}{'ms':>9}{'GB/s':>7}")
    for name, t in median.items():
        print(f"{name:<24}{t * 1e3:>9.1f}{nbytes / t / 1e9:>7.2f}")
    print(f"with / without: save {ratios['save']:.2f}x, load {ratios['load']:.2f}x "
          f"(+{(median['save, with checksums'] - median['save, without']) * 1e3:.0f} ms, "
          f"+{(median['load, verified'] - median['load, not verified']) * 1e3:.0f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tensors": len(found), "bytes": nbytes, "file_bytes": file_bytes,
                       "threads": torch.get_num_threads(), "median_s": median, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
