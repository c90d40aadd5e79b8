"""The accuracy cost of gradient compression: torch's DDP compression hooks and
mpfp16's 8-bit and top-k wires on an fp32 model, beside mpfp16's fp16 model with its
16-bit allreduce.

    python -m mpfp16.bench.compression [--steps 57] [--seeds 0,1,2] [--methods fp32,powersgd-r1] \\
        [--json PATH] [--plot PATH]
    python -m mpfp16.bench.compression --from-json PATH[,PATH...] [--plot PATH]   # no training

Each method and seed is one run of train_cifar.py on its embedded synthetic data
(resnet9-w8, 5000 training and 1000 validation images, batch 128 per process) under
``torchrun --standalone --nproc_per_node 2`` (gloo, CPU, one thread per process), for
``--steps`` optimizer steps (``--max-steps``; ``--epochs`` is set so that the one-cycle
lr schedule ends with the run), in its own temporary checkpoint folder. From the run's
metrics.jsonl: the validation at its last step, and the median of ``allreduce_bytes``
over its steps, the payload (PowerSGD sends whole gradients for its first
``--powersgd-start-iter`` steps, 2; the 8-bit wires count codes and scales, top-k
values and int32 indices: the message each rank encodes). The methods:

  fp32              fp32 model, plain allreduce in fp32 (Nesterov SGD, the script's default)
  fp32-no-nesterov  the same with plain momentum SGD: top-k's baseline
  fp16_compress     fp32 model, torch's fp16_compress_hook
  bf16_compress     fp32 model, torch's bf16_compress_hook
  fp8-e4m3          fp32 model, mpfp16's fp8_compress wire, e4m3 codes, a scale per 256
  fp8-e4m3-ef       the same with error feedback
  fp8-e5m2          fp8_compress with e5m2 codes
  fp8-e5m2-ef       the same with error feedback
  int8              fp32 model, mpfp16's int8_compress wire
  int8-ef           the same with error feedback
  powersgd-r1       fp32 model, torch's powerSGD_hook, rank 1 (error feedback, warm start)
  powersgd-r4       the same, rank 4
  topk-1%           fp32 model, mpfp16's topk wire (DGC: momentum correction, the
                    script's --momentum in the exchange, plain SGD), 1% of each parameter
  topk-0.1%         the same, 0.1%
  mpfp16-fp16       fp16 model with fp32 masters, fp16 allreduce
  mpfp16-fp32acc    fp16 model with fp32 masters, fp16 on the wire, fp32 sums

Every method but fp32-no-nesterov and top-k trains with the script's Nesterov SGD;
top-k cannot (its momentum is applied in the exchange), so fp32-no-nesterov is its
like-for-like baseline.

The table gives each method's mean over the seeds ± half their range, (max - min) / 2,
its payload per step and that payload over fp32's (the ``fp32`` method of the same
run), its mean accuracy minus ``fp16_compress``'s (the 16-bit wire), starred where
the two methods' seed ranges (min to max) do not overlap, and the mean wall time of a
run, start-up included. ``--plot`` draws accuracy (the mean, the spread as error
bars) against the payload per step, log scale, with fp16_compress's seed range as a
band.
``--json`` is rewritten after every run, so that a benchmark stopped half-way keeps
the runs it finished. ``--from-json`` reads the runs of earlier ``--json`` outputs
(several: their runs together, each method's seeds pooled) and prints their table
(and plot) without training. A run that fails stops the benchmark with one line naming the method, the
seed and the run's last error line.
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
DEFAULT_STEPS = 57  # 3 epochs of the embedded set, as train_cifar.py runs it; about 14 s a run on 2 cores
_FP32 = ["--precision", "fp32", "--allreduce-strategy"]
METHODS = {
    "fp32": [*_FP32, "allreduce"],
    "fp32-no-nesterov": [*_FP32, "allreduce", "--no-nesterov"],
    "fp16_compress": [*_FP32, "fp16_compress"],
    "bf16_compress": [*_FP32, "bf16_compress"],
    "fp8-e4m3": [*_FP32, "fp8_compress", "--fp8-format", "e4m3"],
    "fp8-e4m3-ef": [*_FP32, "fp8_compress", "--fp8-format", "e4m3", "--error-feedback"],
    "fp8-e5m2": [*_FP32, "fp8_compress", "--fp8-format", "e5m2"],
    "fp8-e5m2-ef": [*_FP32, "fp8_compress", "--fp8-format", "e5m2", "--error-feedback"],
    "int8": [*_FP32, "int8_compress"],
    "int8-ef": [*_FP32, "int8_compress", "--error-feedback"],
    "powersgd-r1": [*_FP32, "powersgd", "--powersgd-rank", "1"],
    "powersgd-r4": [*_FP32, "powersgd", "--powersgd-rank", "4"],
    "topk-1%": [*_FP32, "topk", "--topk-ratio", "0.01", "--no-nesterov"],
    "topk-0.1%": [*_FP32, "topk", "--topk-ratio", "0.001", "--no-nesterov"],
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
            "val_acc1_min": min(r["val_acc1"] for r in rows), "val_acc1_max": max(r["val_acc1"] for r in rows),
            "wall_s": statistics.fmean(r["wall_s"] for r in rows),
            "train_s": statistics.fmean(r["train_s"] for r in rows)}


def payload_ratios(methods: list[dict], baseline: str = "fp32") -> dict[str, float | None]:
    """Each method's payload per step over ``baseline``'s (None without that method)."""
    base = next((m["payload_bytes"] for m in methods if m["method"] == baseline), None)
    return {m["method"]: (m["payload_bytes"] / base if base else None) for m in methods}


REFERENCE = "fp16_compress"  # the 16-bit wire that the narrower ones are held to


def against(methods: list[dict], reference: str = REFERENCE) -> dict[str, dict | None]:
    """Each method's accuracy beside ``reference``'s: ``delta`` (the difference of the
    means, points) and ``apart`` (True when the two methods' seed ranges, min to max,
    do not overlap: a cost, or a gain, that the seeds' spread does not explain).
    None for every method when ``reference`` was not run, or for runs without the
    ranges (older outputs)."""
    ref = next((m for m in methods if m["method"] == reference), None)
    out: dict[str, dict | None] = {}
    for m in methods:
        if ref is None or "val_acc1_min" not in m or "val_acc1_min" not in ref:
            out[m["method"]] = None
            continue
        apart = m["val_acc1_max"] < ref["val_acc1_min"] or m["val_acc1_min"] > ref["val_acc1_max"]
        out[m["method"]] = {"delta": m["val_acc1"] - ref["val_acc1"], "apart": apart}
    return out


def table(methods: list[dict], steps: int, seeds: list[int]) -> str:
    ratios = payload_ratios(methods)
    beside = against(methods)
    lines = [f"# train_cifar.py, embedded data, {steps} steps, {PROCESSES} processes (gloo, CPU), seeds "
             f"{','.join(map(str, seeds))}; mean ± half the range over seeds, (max - min) / 2; "
             f"vs {REFERENCE}: the accuracy means' difference, * where the seeds' ranges do not overlap; "
             "payload / fp32: over the fp32 method's",
             f"{'method':<16}{'payload MB/step':>16}{'val acc1 %':>16}{'vs ' + REFERENCE:>19}{'val loss':>18}"
             f"{'payload / fp32':>16}{'seeds':>7}{'wall s/run':>12}"]
    for m in methods:
        ratio, b = ratios[m["method"]], beside[m["method"]]
        delta = "-" if b is None else f"{b['delta']:+.2f}{'*' if b['apart'] else ' '}"
        lines.append(f"{m['method']:<16}{m['payload_bytes'] / 1e6:>16.4f}"
                     f"{m['val_acc1']:>10.2f} ± {m['val_acc1_spread']:<4.2f}{delta:>19}"
                     f"{m['val_loss']:>11.4f} ± {m['val_loss_spread']:<6.4f}"
                     f"{'-' if ratio is None else format(ratio, '.4f'):>16}{len(m['seeds']):>7}{m['wall_s']:>12.1f}")
    return "\n".join(lines)


def _family(method: str) -> str:
    for prefix in ("fp8-e4m3", "fp8-e5m2", "int8", "powersgd", "topk", "mpfp16"):
        if method.startswith(prefix):
            return prefix
    return "16/32-bit" if method in ("fp16_compress", "bf16_compress") else "fp32"


def plot(methods: list[dict], steps: int, path: str) -> None:
    """Left: accuracy (mean, the spread as error bars) against the payload per step
    (log x). Right: the methods within 2 points of the best, one column each in order
    of payload, each seed's accuracy as a dot (the left panel's points overlap there)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(_family(m["method"]) for m in methods))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    fig, (ax, near) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    ref = next((m for m in methods if m["method"] == REFERENCE and "val_acc1_min" in m), None)
    for m in methods:
        family = _family(m["method"])
        fed_back = m["method"].endswith("-ef")
        ax.errorbar(m["payload_bytes"], m["val_acc1"], yerr=m["val_acc1_spread"], fmt="s" if fed_back else "o",
                    color=colors[family], mfc="white" if fed_back else colors[family], capsize=3, ms=6)
        ax.annotate(m["method"], (m["payload_bytes"], m["val_acc1"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("payload per step per rank (bytes, log scale)")
    ax.set_ylabel("final validation accuracy (%)")
    seeds = sorted({s for m in methods for s in m["seeds"]})
    ax.set_title(f"train_cifar.py, embedded data, {steps} steps, {PROCESSES} processes; mean over seeds "
                 f"{','.join(map(str, seeds))}, bars: half the range\n(open squares: with error feedback)",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    best = max(m["val_acc1"] for m in methods)
    top = sorted((m for m in methods if m["val_acc1"] >= best - 2), key=lambda m: m["payload_bytes"])
    for i, m in enumerate(top):
        color = colors[_family(m["method"])]
        low, high = m.get("val_acc1_min", m["val_acc1"]), m.get("val_acc1_max", m["val_acc1"])
        near.plot([i, i], [low, high], color=color, lw=2)
        near.plot(i, m["val_acc1"], "s" if m["method"].endswith("-ef") else "o", color=color, ms=6,
                  mfc="white" if m["method"].endswith("-ef") else color)
    if ref is not None:
        for a in (ax, near):
            a.axhspan(ref["val_acc1_min"], ref["val_acc1_max"], color="gray", alpha=0.15,
                      label=f"{REFERENCE}: its seeds' range")
        ax.legend(fontsize=8, loc="lower right")
    near.set_xticks(range(len(top)), [f"{m['method']}\n{m['payload_bytes'] / 1e3:.0f} kB" for m in top],
                    rotation=60, fontsize=7)
    near.set_ylabel("final validation accuracy (%)")
    near.set_title("within 2 points of the best: mean and min-max over the seeds, by payload", fontsize=9)
    near.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def from_json(paths: list[str]) -> tuple[int, list[int], list[dict], list[dict]]:
    """The runs of earlier ``--json`` outputs, pooled per method (in the order methods
    first appear): steps, seeds, per-method summaries, runs. Raises BenchError when
    a file cannot be read or the files ran different step counts."""
    runs, steps = [], set()
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            steps.add(data["steps"])
            runs += data["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchError(f"--from-json {path}: not a compression benchmark output ({exc})") from None
    if len(steps) != 1:
        raise BenchError(f"--from-json: the files ran different step counts ({', '.join(map(str, sorted(steps)))})")
    if not runs:
        raise BenchError(f"--from-json {','.join(paths)}: no runs in them")
    by_method: dict[str, dict[int, dict]] = {}
    try:
        for r in runs:
            by_method.setdefault(r["method"], {})[r["seed"]] = r  # a later file's run of a seed replaces an earlier
        methods = [aggregate([rows[s] for s in sorted(rows)]) for rows in by_method.values()]
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"--from-json {','.join(paths)}: a run lacks what the table needs "
                         f"({type(exc).__name__}: {exc})") from None
    seeds = sorted({r["seed"] for r in runs})
    return steps.pop(), seeds, methods, [r for rows in by_method.values() for r in rows.values()]


def write_json(path: str, steps: int, seeds: list[int], methods: list[dict], runs: list[dict], wall: float) -> None:
    """Every run and each method's summary (with its payload over fp32's), as
    ``--from-json`` reads them back; written whole to a temporary file first, so that
    a benchmark stopped while writing leaves the previous version."""
    ratios = payload_ratios(methods)
    data = {"steps": steps, "seeds": seeds, "processes": PROCESSES,
            "spread": "half the range over seeds, (max - min) / 2", "wall_s": wall,
            "methods": [{**m, "payload_vs_fp32": ratios[m["method"]]} for m in methods], "runs": runs}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


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
    p.add_argument("--methods", type=_list_of(str, list(METHODS)), default=None,
                   help=f"methods, comma-separated; with --from-json, the ones to show (default: all: "
                        f"{','.join(METHODS)})".replace("%", "%%"))
    p.add_argument("--json", metavar="PATH", help="write every run and each method's summary as JSON (default: none)")
    p.add_argument("--plot", metavar="PATH",
                   help="draw accuracy against payload bytes per step (matplotlib; default: none)")
    p.add_argument("--from-json", metavar="PATHS", type=_list_of(str),
                   help="train nothing: pool the runs of earlier --json outputs (comma-separated) and print their "
                        "table (--plot draws it, --json writes the pooled runs)")
    return p


def _writable(parser, flag: str, path: str | None) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{flag} {path}: its folder does not exist")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _writable(parser, "--json", args.json)
    _writable(parser, "--plot", args.plot)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    started = time.perf_counter()
    if args.from_json:
        try:
            steps, seeds, methods, runs = from_json(args.from_json)
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.methods is not None:  # the ones asked for, in the order asked
            missing = [m for m in args.methods if m not in {s["method"] for s in methods}]
            if missing:
                print(f"error: --methods {missing[0]}: not in the --from-json files", file=sys.stderr)
                return 1
            methods = [next(s for s in methods if s["method"] == m) for m in args.methods]
            runs = [r for r in runs if r["method"] in args.methods]
            seeds = sorted({r["seed"] for r in runs})
    else:
        if not os.path.isfile(SCRIPT):
            print(f"error: {SCRIPT} is missing: run the benchmark from a checkout of mpfp16", file=sys.stderr)
            return 2
        steps, seeds = args.steps, args.seeds
        runs, methods = [], []
        try:
            for method in args.methods or list(METHODS):
                rows = []
                for seed in args.seeds:
                    row = run_one(method, seed, args.steps)
                    print(f"{method} seed {seed}: val acc1 {row['val_acc1']:.2f}%, val loss {row['val_loss']:.4f}, "
                          f"{row['payload_bytes'] / 1e6:.4f} MB/step, {row['wall_s']:.1f} s", flush=True)
                    rows.append(row)
                    if args.json:  # so far: a benchmark stopped half-way keeps its runs (--from-json reads them)
                        write_json(args.json, steps, seeds, methods + [aggregate(rows)], runs + rows,
                                   time.perf_counter() - started)
                runs += rows
                methods.append(aggregate(rows))
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    # the runs' own time (pooled: the time they took when they ran, not this reading)
    wall = sum(r["wall_s"] for r in runs) if args.from_json else time.perf_counter() - started
    print(table(methods, steps, seeds))
    if not args.from_json:
        print(f"# {len(runs)} runs in {wall:.0f} s")
    if args.json:
        write_json(args.json, steps, seeds, methods, runs, wall)
    if args.plot:
        plot(methods, steps, args.plot)
        print(f"# plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
