"""The bandwidth study across a real (emulated) link: two nodes, one shaped link, torchrun.

    python -m mpfp16.bench.netem --rates 1gbit,10gbit,25gbit --sizes 1M,16M,100M \\
        [--wires fp8-e4m3,int8,topk-1%] [--delay 0] [--model resnet50] [--json PATH] [--plot PATH]

For each rate the link between two network namespaces (mpfp16.bench.links) is shaped
with a token-bucket filter, measured with one TCP stream (throughput and round trip),
and then each namespace launches ``torchrun --nnodes 2 --nproc_per_node 1
--rdzv-backend c10d``, so that every collective crosses the link:

- the collective sweep of mpfp16.bench.allreduce (every type at the same element count,
  the 16-bit ones and, with ``--wires``, the 8-bit and top-k wires; the slowest rank's
  median time with its min and max, algbw and busbw, and the bytes each node put on
  its interface, headers included);
- with ``--model``, the training-step view of mpfp16.bench.allreduce over the same link:
  one row per set-up (fp32 and fp16 models, mpfp16's strategies, torch's compression
  hooks and mpfp16's 8-bit and top-k wires), with the step time's min, median and
  max, the communication in flight, the part of it backward did not hide (exposed)
  and the bytes on the wire per step.

Then it prints, per rate, each type's time, message bytes and interface bytes over
fp32's at the same element count (fp32 measured in the same run), the step view's
times and bytes over the fp32 model's, and the link rate from which each narrower
wire stops paying, and removes the namespaces (after a failure or Ctrl-C too). Needs root, ``ip`` and ``tc``;
without them it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ..errors import last_error_line
from .allreduce import DTYPES, SETUPS, WIRE_SETUPS, WIRES, fp32_ratios, parse_list, parse_size, step_ratios
from .links import EmulatedLink, LinkError, parse_delay, parse_rate, unavailable

RDZV_PORT = 29400
STEP_SETUPS = ("fp32", "fp32-fp16-compress", "fp32-bf16-compress", "fp32-powersgd-r1", "fp32-powersgd-r4",
               *WIRE_SETUPS, "fp16-fp32-allreduce", "fp16", "fp16-fp32-accumulate")
# Pairs with the same compute and another wire format: (32-bit wire, narrower wire).
WIRE_PAIRS = (("fp32", "fp32-fp16-compress"), ("fp16-fp32-allreduce", "fp16"), ("fp32", "fp32-fp8-e4m3"),
              ("fp32", "fp32-int8"), ("fp32", "fp32-topk-0.01"))
# Step-view set-up -> method name of mpfp16.bench.compression (its accuracy cost).
ACCURACY_METHOD = {"fp32": "fp32", "fp32-fp16-compress": "fp16_compress", "fp32-bf16-compress": "bf16_compress",
                   "fp32-powersgd-r1": "powersgd-r1", "fp32-powersgd-r4": "powersgd-r4", "fp16": "mpfp16-fp16",
                   "fp16-fp32-accumulate": "mpfp16-fp32acc", "fp32-fp8-e4m3": "fp8-e4m3",
                   "fp32-fp8-e4m3-ef": "fp8-e4m3-ef", "fp32-fp8-e5m2": "fp8-e5m2", "fp32-fp8-e5m2-ef": "fp8-e5m2-ef",
                   "fp32-int8": "int8", "fp32-int8-ef": "int8-ef", "fp32-topk-0.01": "topk-1%",
                   "fp32-topk-0.001": "topk-0.1%"}
MATTERS = 0.05  # a narrower wire "matters" while it saves more than 5% of the step


class JobError(RuntimeError):
    """A torchrun job on the emulated nodes failed or ran out of time."""


def _log_error_line(path: str) -> str:
    """Why a node's job failed, from its log (c10d's reverse-DNS warnings skipped)."""
    with open(path, errors="replace") as f:
        return last_error_line(f.read(), skip=("hostname of the client socket",))


def run_job(link: EmulatedLink, argv: list[str], log_dir: str, name: str, timeout_s: float, threads: int,
            node_argv=None) -> None:
    """Run ``python ARGV`` (``-m MODULE ...`` or ``SCRIPT ...``) on both nodes under
    torchrun's c10d rendezvous, node a hosting the store, each node's output in
    ``LOG_DIR/NAME-NODE.log``; ``node_argv(node)`` adds arguments for one node. Raise
    :class:`JobError` naming the node that failed, or the time limit."""
    procs, logs = {}, {}
    try:
        for node in ("a", "b"):
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{link.addrs['a']}:{RDZV_PORT}",
                    "--rdzv-id", f"{name}-{os.getpid()}", "--rdzv-conf", f"is_host={node == 'a'}",
                    "--local-addr", link.addrs[node], *argv, *(node_argv(node) if node_argv else [])]
            env = {"GLOO_SOCKET_IFNAME": link.ifaces[node], "OMP_NUM_THREADS": str(threads)}
            logs[node] = os.path.join(log_dir, f"{name}-{node}.log")
            with open(logs[node], "w") as log:
                procs[node] = subprocess.Popen(link.argv(node, launch, env), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                raise JobError(f"{name}: node {failed[0]} exited with status {procs[failed[0]].returncode}: "
                               f"{_log_error_line(logs[failed[0]])}")
            if time.monotonic() > deadline:
                raise JobError(f"{name}: did not finish within {timeout_s:.0f}s (--timeout-s)")
            time.sleep(0.2)
        for node, p in procs.items():
            if p.returncode != 0:
                raise JobError(f"{name}: node {node} exited with status {p.returncode}: "
                               f"{_log_error_line(logs[node])}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _read_rows(path: str, name: str) -> list[dict]:
    try:
        with open(path) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as exc:
        raise JobError(f"{name}: its results ({path}) could not be read: {exc}") from None


# ---------------------------------------------------------------------- analysis


def wire_ratios(rows: list[dict]) -> list[dict]:
    """Per rate and element count: each type's time over fp32's (medians; and min over
    min, max over max), its message and interface bytes over fp32's, and its busbw;
    every ratio within one rate's run."""
    out = []
    group = ("rate_gbps", "count")
    ratios = {key: fp32_ratios(rows, key, group) for key in ("time_us", "time_min_us", "time_max_us", "size_bytes",
                                                              "wire_bytes")}
    for i, r in enumerate(rows):
        if ratios["time_us"][i] is None:
            continue
        out.append({"rate_gbps": r["rate_gbps"], "count": r["count"], "dtype": r["dtype"],
                    "vs_fp32": ratios["time_us"][i], "min_vs_fp32": ratios["time_min_us"][i],
                    "max_vs_fp32": ratios["time_max_us"][i], "bytes_vs_fp32": ratios["size_bytes"][i],
                    "wire_vs_fp32": ratios["wire_bytes"][i], "busbw_gbps": r["busbw_gbps"],
                    "time_ms": r["time_us"] / 1e3, "time_min_ms": r.get("time_min_us", r["time_us"]) / 1e3,
                    "time_max_ms": r.get("time_max_us", r["time_us"]) / 1e3})
    return out


def step_time_s(row: dict, accum: int) -> float:
    return accum / row["its_per_s"]


def stops_mattering(step_rows: list[dict], accum: int) -> list[dict]:
    """For each pair of set-ups with the same compute and a 32- or 16-bit wire: what
    the 16-bit wire saves at each rate, and the lowest measured rate from which the
    saving stays under 5% of the step.

    The saving is the exposed communication it removes (32-bit exposed minus 16-bit
    exposed) over the 32-bit step time: the part of the step that depends on the
    wire. The step times themselves are reported beside it (``speedup_by_rate``), but
    on a shared CPU their run-to-run noise is larger than the saving, while the
    exposed time is measured within each backward pass."""
    out = []
    for wide, narrow in WIRE_PAIRS:
        by_rate = {}
        for r in step_rows:
            if r["processes"] > 1 and r["key"] in (wide, narrow):
                by_rate.setdefault(r["rate_gbps"], {})[r["key"]] = r
        rates = sorted(rate for rate, pair in by_rate.items() if len(pair) == 2)
        if not rates:
            continue
        gains = {rate: (by_rate[rate][wide]["exposed_ms"] - by_rate[rate][narrow]["exposed_ms"]) / 1e3
                 / step_time_s(by_rate[rate][wide], accum) for rate in rates}
        speedups = {rate: step_time_s(by_rate[rate][wide], accum) / step_time_s(by_rate[rate][narrow], accum) - 1
                    for rate in rates}
        below = None
        for rate in reversed(rates):
            if gains[rate] >= MATTERS:
                break
            below = rate
        out.append({"wide": wide, "narrow": narrow, "gain_by_rate": gains, "speedup_by_rate": speedups,
                    "stops_mattering_gbps": below,
                    "max_rate_gbps": rates[-1]})
    return out


def _x(value) -> str:
    return f"{value:.3f}" if value is not None else "-"


def summary_text(sweep_rows: list[dict], step_rows: list[dict], accum: int) -> str:
    lines = []
    ratios = wire_ratios(sweep_rows)
    if ratios:
        lines.append("# collective sweep by link rate: time in ms, median and min-max over the rounds (the slowest "
                     "node's); time, message bytes and interface bytes over fp32's at the same element count "
                     "(same rate's run); busbw GB/s")
        lines.append(f"{'rate Gbit/s':>12}{'count':>11}{'type':>12}{'time_ms':>10}{'min-max':>19}{'vs fp32':>9}"
                     f"{'bytes x':>9}{'wire x':>9}{'busbw':>8}")
        for r in ratios:
            spread = f"{r['time_min_ms']:.1f}-{r['time_max_ms']:.1f}"
            lines.append(f"{r['rate_gbps']:>12g}{r['count']:>11}{r['dtype']:>12}{r['time_ms']:>10.1f}{spread:>19}"
                         f"{r['vs_fp32']:>9.3f}{_x(r['bytes_vs_fp32']):>9}{_x(r['wire_vs_fp32']):>9}"
                         f"{r['busbw_gbps']:>8.3f}")
    if step_rows:
        lines.append("# training steps by rate: step time (s) min-median-max over the timed steps (the slowest "
                     "node's), communication in flight and exposed (ms, median), payload and interface MB per "
                     "step; x fp32: over the fp32 model's row at the same rate")
        lines.append(f"{'setup':<26}{'rate':>6}{'step s min-med-max':>21}{'comm_ms':>9}{'x fp32':>8}{'exposed':>9}"
                     f"{'x fp32':>8}{'MB':>8}{'x fp32':>8}{'wire MB':>9}{'x fp32':>8}")
        multi = [r for r in step_rows if r["processes"] > 1]
        x = {k: step_ratios(multi, k) for k in ("comm_ms", "exposed_ms", "bytes_per_step", "wire_bytes_per_step")}
        for i, r in enumerate(multi):
            spread = (f"{r['step_s_min']:.3f}-{r['step_s_median']:.3f}-{r['step_s_max']:.3f}" if "step_s_median" in r
                      else f"{step_time_s(r, accum):.3f}")
            lines.append(f"{r['setup']:<26}{r['rate_gbps']:>6g}{spread:>21}{r['comm_ms']:>9.1f}"
                         f"{_x(x['comm_ms'][i]):>8}{r['exposed_ms']:>9.1f}{_x(x['exposed_ms'][i]):>8}"
                         f"{r['bytes_per_step'] / 1e6:>8.2f}{_x(x['bytes_per_step'][i]):>8}"
                         f"{r.get('wire_bytes_per_step', 0) / 1e6:>9.2f}{_x(x['wire_bytes_per_step'][i]):>8}")
        for s in stops_mattering(step_rows, accum):
            gains = ", ".join(f"{rate:g} Gbit/s {100 * g:.0f}% ({100 * s['speedup_by_rate'][rate]:+.0f}%)"
                              for rate, g in s["gain_by_rate"].items())
            where = (f"stops mattering (under {100 * MATTERS:.0f}%) from {s['stops_mattering_gbps']:g} Gbit/s"
                     if s["stops_mattering_gbps"] is not None
                     else f"still matters at {s['max_rate_gbps']:g} Gbit/s, the fastest rate measured")
            lines.append(f"# narrower wire, {SETUPS[s['narrow']][0]} vs {SETUPS[s['wide']][0]}, exposed time saved "
                         f"per step (step-time speed-up): {gains}; {where}")
    return "\n".join(lines)


def load_accuracy(path: str) -> dict:
    """mpfp16.bench.compression's JSON: method name -> its summary row (one line on error)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {m["method"]: {**m, "steps": data["steps"], "seeds": data["seeds"]} for m in data["methods"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--accuracy {path}: not a JSON file written by mpfp16.bench.compression ({exc})") from None


def compression_rows(step_rows: list[dict], accuracy: dict, accum: int) -> list[dict]:
    """One row per set-up and rate: payload and wire bytes per step (and the payload
    over the fp32 model's at the same rate), step time, exposed communication, and
    (from ``accuracy``) the final validation accuracy and loss."""
    out = []
    multi = [r for r in step_rows if r["processes"] > 1]
    payload_x = step_ratios(multi, "bytes_per_step")
    for r, x in zip(multi, payload_x):
        acc = accuracy.get(ACCURACY_METHOD.get(r["key"], ""), {})
        out.append({"setup": r["setup"], "key": r["key"], "rate_gbps": r["rate_gbps"],
                    "payload_mb": r["bytes_per_step"] / 1e6, "payload_vs_fp32": x,
                    "wire_mb": r.get("wire_bytes_per_step", 0) / 1e6,
                    "step_s": step_time_s(r, accum), "comm_ms": r["comm_ms"], "exposed_ms": r["exposed_ms"],
                    **{k: acc[k] for k in ("val_acc1", "val_acc1_spread", "val_loss", "val_loss_spread")
                       if k in acc}})
    return out


def compression_text(rows: list[dict]) -> str:
    lines = [f"{'setup':<26}{'rate':>6}{'payload MB':>11}{'x fp32':>8}{'wire MB':>9}{'step_s':>8}{'exposed':>9}"
             f"{'val acc1 %':>16}{'val loss':>16}"]
    for r in rows:
        acc = f"{r['val_acc1']:.2f} ± {r['val_acc1_spread']:.2f}" if "val_acc1" in r else "-"
        loss = f"{r['val_loss']:.3f} ± {r['val_loss_spread']:.3f}" if "val_loss" in r else "-"
        lines.append(f"{r['setup']:<26}{r['rate_gbps']:>6g}{r['payload_mb']:>11.1f}"
                     f"{_x(r.get('payload_vs_fp32')):>8}{r['wire_mb']:>9.1f}"
                     f"{r['step_s']:>8.3f}{r['exposed_ms']:>9.1f}{acc:>16}{loss:>16}")
    return "\n".join(lines)


def plot(sweep_rows: list[dict], step_rows: list[dict], accum: int, path: str) -> None:
    """Time against link rate, one line per wire format: one panel per message size,
    and with a model, one panel of step time per set-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20")
    counts = sorted({r["count"] for r in sweep_rows})
    panels = max(1, len(counts) + (1 if step_rows else 0))
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4), squeeze=False)
    for ax, count in zip(axes[0], counts):
        for i, t in enumerate(dict.fromkeys(r["dtype"] for r in sweep_rows)):
            pts = sorted((r["rate_gbps"], r["time_us"] / 1e3) for r in sweep_rows
                         if r["dtype"] == t and r["count"] == count)
            ax.plot(*zip(*pts), marker="o", label=t, color=colors(i % colors.N))
        ax.set_title(f"allreduce of {count:,} elements")
        ax.set_ylabel("time (ms)")
    if step_rows:
        ax = axes[0][-1]
        for i, key in enumerate(dict.fromkeys(r["key"] for r in step_rows)):
            pts = sorted((r["rate_gbps"], step_time_s(r, accum)) for r in step_rows
                         if r["key"] == key and r["processes"] > 1)
            ax.plot(*zip(*pts), marker="o", label=SETUPS[key][0], color=colors(i % colors.N))
        ax.set_title("training step, 2 nodes")
        ax.set_ylabel("step time (s)")
    for ax in axes[0]:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,10gbit,25gbit",
                   help="link rates, tc units (default: 1gbit,10gbit,25gbit)")
    p.add_argument("--delay", default="0", help="one-way delay added by netem, e.g. 50us (default: 0; "
                                                "refused where the kernel has no netem)")
    p.add_argument("--sizes", default="1M,16M,100M",
                   help="fp32 message sizes of the sweep, or 'none' to skip it (default: 1M,16M,100M)")
    p.add_argument("--dtypes", type=parse_list(list(DTYPES)), default="fp32,fp16,bf16",
                   help="types of the sweep (default: fp32,fp16,bf16)")
    p.add_argument("--wires", type=parse_list(list(WIRES), allow_none=True), default=",".join(WIRES),
                   help=(f"mpfp16's 8-bit and top-k exchanges in the sweep, or none (default: {','.join(WIRES)})")
                   .replace("%", "%%"))
    p.add_argument("--iters", type=int, default=5, help="timed rounds of the sweep (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    g = p.add_argument_group("training-step view")
    g.add_argument("--model", default=None, help="also time training steps of this model across the link: a GPT "
                                                 "size (imagegpt-s, gpt2) or a torchvision model (default: none)")
    g.add_argument("--setups", type=parse_list(list(SETUPS)), default=",".join(STEP_SETUPS),
                   help=f"set-ups of the step view (default: {','.join(STEP_SETUPS)})")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    g.add_argument("--steps", type=int, default=3, help="timed optimizer steps per set-up (default: 3)")
    g.add_argument("--batch-size", type=int, default=4, help="images or sequences per micro-batch (default: 4)")
    g.add_argument("--image-size", type=int, default=32, help="image side (default: 32)")
    g.add_argument("--seq-len", type=int, default=8, help="tokens per sequence, GPT sizes (default: 8)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="compute threads per node (default: half the CPUs)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="longest a job (one rate's sweep or step view) may run (default: 1800)")
    p.add_argument("--accuracy", default=None, metavar="PATH",
                   help="JSON of mpfp16.bench.compression: adds each method's accuracy cost to the compression "
                        "table (default: none)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every row as JSON (default: none)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="time against link rate (default: none)")
    return p


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    args = parser.parse_args(argv)
    try:
        args.rate_list = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
        args.delay_s = parse_delay(args.delay)
        args.size_list = ([] if args.sizes.strip().lower() == "none"
                          else [parse_size(s) for s in args.sizes.split(",") if s.strip()])
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    if not args.rate_list:
        parser.error("--rates: give at least one rate")
    if not args.size_list and args.model is None:
        parser.error("--sizes none leaves nothing to measure: give --model too")
    for name in ("iters", "accum", "steps", "batch_size", "image_size", "seq_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or not args.timeout_s > 0:
        parser.error("--warmup must be 0 or more and --timeout-s positive")
    if args.model is not None:
        from .allreduce import model_names

        if args.model not in model_names():
            parser.error(f"unknown model {args.model!r}: a GPT size (imagegpt-s, gpt2) or a torchvision model")
    if args.accuracy is not None:
        if args.model is None:
            parser.error("--accuracy goes with --model: it joins the step view's compression table")
        try:
            args.accuracy_by_method = load_accuracy(args.accuracy)
        except ValueError as exc:
            parser.error(str(exc))
    for path in (args.json, args.plot):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error(f"cannot write {path}: {folder} is not a folder")
    return args


def main(argv=None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    reason = unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    sweep_args = ["-m", "mpfp16.bench.allreduce", "--sizes", args.sizes, "--dtypes", ",".join(args.dtypes),
                  "--wires", ",".join(args.wires) or "none", "--iters", str(args.iters), "--warmup", str(args.warmup)]
    step_args = ["-m", "mpfp16.bench.allreduce", "--model", str(args.model), "--setups", ",".join(args.setups),
                 "--accum", str(args.accum), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                 "--image-size", str(args.image_size), "--seq-len", str(args.seq_len)]
    links, sweep_rows, step_rows = [], [], []
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="mpfp16-netem-") as tmp, EmulatedLink() as link:
            def wire(node):  # each node counts what it sends on its own end of the link
                return ["--wire-iface", link.ifaces[node]]

            for i, rate in enumerate(args.rate_list):
                link.shape(rate, args.delay_s)
                probe = link.probe()
                common = {"rate_gbps": rate / 1e9, "delay_us": args.delay_s * 1e6, **probe}
                links.append(common)
                print(f"link {rate / 1e9:g} Gbit/s, delay {args.delay_s * 1e6:g} us: one TCP stream measured "
                      f"{probe['link_gbps']:.2f} Gbit/s, round trip {probe['rtt_us']:.0f} us", flush=True)
                if args.size_list:
                    out = os.path.join(tmp, f"sweep-{i}.json")
                    run_job(link, sweep_args + ["--json", out], tmp, f"sweep-{i}", args.timeout_s, args.threads,
                            wire)
                    sweep_rows += [{**common, **r} for r in _read_rows(out, f"sweep-{i}")]
                    print(f"  sweep done ({time.perf_counter() - started:.0f} s so far)", flush=True)
                if args.model:
                    out = os.path.join(tmp, f"steps-{i}.json")
                    modes = "single,sync" if i == 0 else "sync"  # one process does not cross the link
                    run_job(link, step_args + ["--modes", modes, "--json", out], tmp, f"steps-{i}",
                            args.timeout_s, args.threads, wire)
                    step_rows += [{**common, **r} for r in _read_rows(out, f"steps-{i}")]
                    print(f"  {args.model} steps done ({time.perf_counter() - started:.0f} s so far)", flush=True)
    except (LinkError, JobError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; the emulated nodes were removed", file=sys.stderr)
        return 130
    print(summary_text(sweep_rows, step_rows, args.accum))
    compression = compression_rows(step_rows, getattr(args, "accuracy_by_method", {}), args.accum)
    if compression:
        print("# compression: payload and wire MB per step, step time (s), exposed ms, accuracy cost "
              "(mpfp16.bench.compression: mean ± half the range over seeds)")
        print(compression_text(compression))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"links": links, "rows": sweep_rows, "step_rows": step_rows, "compression": compression,
                       "step_settings": {k: getattr(args, k) for k in ("model", "accum", "steps", "batch_size",
                                                                         "image_size", "seq_len")},
                       "stops_mattering": stops_mattering(step_rows, args.accum) if step_rows else [],
                       "threads_per_node": args.threads}, f, indent=1)
    if args.plot:
        plot(sweep_rows, step_rows, args.accum, args.plot)
    print(f"done in {time.perf_counter() - started:.0f} s; the emulated nodes were removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
