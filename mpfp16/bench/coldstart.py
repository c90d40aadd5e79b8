"""The fused step's cold start: how long the first ``step()`` of a new process takes,
compiles included, with an empty inductor cache (cold) and with the cache a previous
run left (warm).

    python -m mpfp16.bench.coldstart [--model resnet50] [--optimizer adamw] [--threads 2]
                                     [--runs 3] [--json PATH]

Each run is a new interpreter (this module with ``--child``) over the shapes of
``mpfp16.bench.step`` (fp16 weights, fp32 masters, norm layers fp32), with
``TORCHINDUCTOR_CACHE_DIR`` set to a new empty folder. It times the first step, which
compiles the kernels; the second step; each inductor kernel's first call (its
compile), by name and flags; and the build of the C++ kernels (mpfp16/stores/native.py,
kept in the same cache folder), which the CPU's Adam and AdamW use. After the cold runs, one more run reuses the last run's cache (warm).
The folders are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def first_steps(model: str, optimizer: str, threads: int) -> dict:
    """In this process: the first and second fused step over ``model``'s shapes, and
    each kernel compiled during the first, with its time."""
    from ..stores import kernels, native
    from .step import _Mpfp16, model_params

    compiles = []
    original = kernels.compiled

    def timed(fn, **static):
        inner = original(fn, **static)

        def call(*args):
            before = len(kernels._COMPILED)
            started = time.perf_counter()
            out = inner(*args)
            if len(kernels._COMPILED) > before:
                compiles.append({"kernel": fn.__name__, "flags": {k: str(v) for k, v in static.items()},
                                 "s": time.perf_counter() - started})
            return out

        return call

    before = torch.get_num_threads()
    kernels.compiled = timed
    torch.set_num_threads(threads)
    try:
        opt = _Mpfp16(optimizer, model_params(model, torch.device("cpu")), fused=True)
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            opt._touch()
            opt.step()
            seconds.append(time.perf_counter() - started)
    finally:
        kernels.compiled = original
        torch.set_num_threads(before)
    if native.BUILD_S > 0:
        compiles.append({"kernel": "native.cpp", "flags": {"isa": native.build_isa()}, "s": native.BUILD_S})
    return {"first_step_s": seconds[0], "second_step_s": seconds[1], "compiles": compiles}


def _run_child(args, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, "-m", "mpfp16.bench.coldstart", "--child", "--model", args.model,
                           "--optimizer", args.optimizer, "--threads", str(args.threads)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the child run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from .step import OPTIMIZERS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="gpt2, or a torchvision model (default: resnet50)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default: adamw")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (default: 2)")
    parser.add_argument("--runs", type=int, default=3, help="cold runs, each with an empty cache (default: 3)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1 or args.runs < 1:
        parser.error("--threads and --runs must be >= 1")
    if args.child:
        print(json.dumps(first_steps(args.model, args.optimizer, args.threads)))
        return 0
    folders = [tempfile.mkdtemp(prefix="mpfp16-coldstart-") for _ in range(args.runs)]
    try:
        cold = []
        for i, folder in enumerate(folders):
            cold.append(_run_child(args, folder))
            print(f"cold run {i + 1}/{args.runs}: first step {cold[-1]['first_step_s']:.1f} s", file=sys.stderr,
                  flush=True)
        warm = _run_child(args, folders[-1])
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    firsts = [r["first_step_s"] for r in cold]
    print(f"# {args.model}, {args.optimizer}, fused fp16 + fp32 masters, {args.threads} thread(s)")
    print(f"cold first step: {', '.join(f'{s:.1f}' for s in firsts)} s (median {statistics.median(firsts):.1f} s)")
    print(f"warm first step: {warm['first_step_s']:.1f} s; a step after: {cold[0]['second_step_s'] * 1e3:.0f} ms")
    print("kernels compiled (inductor) or built (native.cpp) in the first cold run:")
    for c in cold[0]["compiles"]:
        flags = ", ".join(f"{k}={v}" for k, v in c["flags"].items())
        print(f"  {c['s']:6.2f} s  {c['kernel']}({flags})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "optimizer": args.optimizer, "threads": args.threads, "cold": cold,
                       "warm": warm}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
