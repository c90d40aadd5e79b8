"""The accuracy cost of gradient compression: torch's DDP compression hooks on an fp32
model, beside mpfp16's fp16 model with its 16-bit allreduce.

    python -m mpfp16.bench.compression [--steps 57] [--seeds 0,1,2] [--methods fp32,powersgd-r1] [--json PATH]

Each method and seed is one run of train_cifar.py on its embedded synthetic data
(resnet9-w8, 5000 training and 1000 validation images, batch 128 per process) under
``torchrun --standalone --nproc_per_node 2`` (gloo, CPU, one thread per process), for
``--steps`` optimizer steps (``--max-steps``; ``--epochs`` is set so that the one-cycle
lr schedule ends with the run), in its own temporary checkpoint folder. From the run's
metrics.jsonl: the validation at its last step, and the median of ``allreduce_bytes``
over its steps, the payload (PowerSGD sends whole gradients for its first
``--powersgd-start-iter`` steps, 2). The methods:

  fp32            fp32 model, plain allreduce in fp32
  fp16_compress   fp32 model, torch's fp16_compress_hook
  bf16_compress   fp32 model, torch's bf16_compress_hook
  powersgd-r1     fp32 model, torch's powerSGD_hook, rank 1 (error feedback, warm start)
  powersgd-r4     the same, rank 4
  mpfp16-fp16     fp16 model with fp32 masters, fp16 allreduce
  mpfp16-fp32acc  fp16 model with fp32 masters, fp16 on the wire, fp32 sums

The table gives each method's mean over the seeds ± half their range, (max - min) / 2,
and the mean wall time of a run, start-up included. A run that fails stops the
benchmark with one line naming the method, the seed and the run's last error line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..errors import last_error_line
from ..train.config import DATA_DEFAULTS, SYNTHETIC_SIZES

PROCESSES = 2
DEFAULT_STEPS = 57  # 3 epochs of the embedded set, as train_cifar.py runs it; the 21 runs: about 11 minutes on 2 cores
METHODS = {
    "fp32": ["--precision", "fp32", "--allreduce-strategy", "allreduce"],
    "fp16_compress": ["--precision", "fp32", "--allreduce-strategy", "fp16_compress"],
    "bf16_compress": ["--precision", "fp32", "--allreduce-strategy", "bf16_compress"],
    "powersgd-r1": ["--precision", "fp32", "--allreduce-strategy", "powersgd", "--powersgd-rank", "1"],
    "powersgd-r4": ["--precision", "fp32", "--allreduce-strategy", "powersgd", "--powersgd-rank", "4"],
    "mpfp16-fp16": ["--precision", "fp16", "--allreduce-strategy", "allreduce"],
    "mpfp16-fp32acc": ["--precision", "fp16", "--allreduce-strategy", "fp32_accumulate"],
}
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train_cifar.py")
RUN_TIMEOUT_S = 3600


class BenchError(Exception):
    """A run that failed or reported less than the benchmark needs: one line."""


def steps_per_epoch() -> int:
    """Optimizer steps in an epoch of the embedded set, at the script's batch, on
    :data:`PROCESSES` processes."""
    return SYNTHETIC_SIZES["cifar"][0] // PROCESSES // DATA_DEFAULTS["cifar"]["embedded"]["batch_size"]


def command(method: str, seed: int, steps: int, folder: str) -> list[str]:
    epochs = math.ceil(steps / steps_per_epoch())
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PROCESSES),
            SCRIPT, *METHODS[method], "--seed", str(seed), "--max-steps", str(steps), "--epochs", str(epochs),
            "--no-progress", "-p", "1", "--checkpoint-dir", folder]


def run_one(method: str, seed: int, steps: int) -> dict:
    """One training run; its final validation, payload and times."""
    with tempfile.TemporaryDirectory(prefix=f"mpfp16-compression-{method}-{seed}-") as folder:
        started = time.perf_counter()
        try:
            proc = subprocess.run(command(method, seed, steps, folder), capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{method} seed {seed}: no result within {RUN_TIMEOUT_S} s") from None
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise BenchError(f"{method} seed {seed} failed (exit status {proc.returncode}): "
                             f"{last_error_line(proc.stderr)}")
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return {"method": method, "seed": seed, **read_metrics(records, method, seed, steps), "wall_s": wall}


def read_metrics(records: list[dict], method: str, seed: int, steps: int) -> dict:
    """The validation at the last step and the median payload per step."""
    evals = [r for r in records if r["type"] == "eval"]
    payload = [r["allreduce_bytes"] for r in records if r["type"] == "train"]
    final = [r for r in records if r["type"] == "final"]
    if not evals or evals[-1]["step"] != steps or not final or final[-1]["step"] != steps:
        raise BenchError(f"{method} seed {seed}: the metrics hold no validation at step {steps}")
    if len(payload) != steps:
        raise BenchError(f"{method} seed {seed}: {len(payload)} logged steps of {steps}")
    return {"val_acc1": evals[-1]["val_acc1"], "val_loss": evals[-1]["val_loss"],
            "payload_bytes": statistics.median(payload), "train_s": final[-1]["wall_s"]}


def aggregate(rows: list[dict]) -> dict:
    """One method's seeds: means, half-ranges, the payload and the mean wall time."""
    def mean_spread(key):
        values = [r[key] for r in rows]
        return statistics.fmean(values), (max(values) - min(values)) / 2

    acc, acc_spread = mean_spread("val_acc1")
    loss, loss_spread = mean_spread("val_loss")
    return {"method": rows[0]["method"], "seeds": [r["seed"] for r in rows],
            "payload_bytes": statistics.median(r["payload_bytes"] for r in rows),
            "val_acc1": acc, "val_acc1_spread": acc_spread, "val_loss": loss, "val_loss_spread": loss_spread,
            "wall_s": statistics.fmean(r["wall_s"] for r in rows),
            "train_s": statistics.fmean(r["train_s"] for r in rows)}


def table(methods: list[dict], steps: int, seeds: list[int]) -> str:
    lines = [f"# train_cifar.py, embedded data, {steps} steps, {PROCESSES} processes (gloo, CPU), seeds "
             f"{','.join(map(str, seeds))}; mean ± half the range over seeds, (max - min) / 2",
             f"{'method':<16}{'payload MB/step':>16}{'val acc1 %':>16}{'val loss':>18}{'wall s/run':>12}"]
    for m in methods:
        lines.append(f"{m['method']:<16}{m['payload_bytes'] / 1e6:>16.4f}"
                     f"{m['val_acc1']:>10.2f} ± {m['val_acc1_spread']:<4.2f}"
                     f"{m['val_loss']:>11.4f} ± {m['val_loss_spread']:<6.4f}{m['wall_s']:>10.1f}")
    return "\n".join(lines)


def _list_of(kind, allowed=None):
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        try:
            values = [kind(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        unknown = [v for v in values if allowed is not None and v not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; choose from {', '.join(allowed)}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{text!r} names one twice")
        return values
    return parse


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpfp16.bench.compression", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_positive, default=DEFAULT_STEPS,
                   help=f"optimizer steps per run (default: {DEFAULT_STEPS})")
    p.add_argument("--seeds", type=_list_of(int), default=[0, 1, 2], help="seeds, comma-separated (default: 0,1,2)")
    p.add_argument("--methods", type=_list_of(str, list(METHODS)), default=list(METHODS),
                   help=f"methods, comma-separated (default: all: {','.join(METHODS)})")
    p.add_argument("--json", metavar="PATH", help="write every run and each method's summary as JSON (default: none)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its folder does not exist")
    if not os.path.isfile(SCRIPT):
        print(f"error: {SCRIPT} is missing: run the benchmark from a checkout of mpfp16", file=sys.stderr)
        return 2
    started = time.perf_counter()
    runs, methods = [], []
    try:
        for method in args.methods:
            rows = []
            for seed in args.seeds:
                row = run_one(method, seed, args.steps)
                print(f"{method} seed {seed}: val acc1 {row['val_acc1']:.2f}%, val loss {row['val_loss']:.4f}, "
                      f"{row['payload_bytes'] / 1e6:.4f} MB/step, {row['wall_s']:.1f} s", flush=True)
                rows.append(row)
            runs += rows
            methods.append(aggregate(rows))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - started
    print(table(methods, args.steps, args.seeds))
    print(f"# {len(runs)} runs in {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "seeds": args.seeds, "processes": PROCESSES,
                       "spread": "half the range over seeds, (max - min) / 2", "wall_s": wall,
                       "methods": methods, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
