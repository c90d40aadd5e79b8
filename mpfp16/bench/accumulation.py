"""What ``accumulate_dtype=torch.float32`` costs: time per micro-step, per step, and memory.

    python -m mpfp16.bench.accumulation [--models resnet50,gpt2] [--fused both|on|off] [--accum 8]
                                        [--optimizer sgd] [--rounds 5] [--warmup 1] [--threads N]
                                        [--json PATH]

For each model's parameter shapes (mpfp16.bench.step.model_params: a torchvision model
by name, ResNet-50 by default, or ``gpt2``; normalization layers' parameters stay fp32,
as ``to_half`` keeps them), two FP16Optimizers over the same fp16 parameters, one with
``accumulate_dtype=None`` and one with ``torch.float32``, fused and unfused (masters in
both). The timed pieces run alternately, one call each per round, after warm-up rounds
(which also compile the fused kernels); the table gives medians:

``accumulate``
    what ``opt.backward()`` does after autograd's backward under fp32 accumulation,
    once per micro-step (``opt.store.accumulate(first)``: the fresh fp16 gradients added
    into the fp32 sum, then zeroed). With ``None`` nothing runs (0).
``backward``
    ``opt.backward(loss)`` of a loss that reaches every parameter with a zero gradient
    and computes nothing else: the gradient arrival alone (autograd's full-size gradient
    per tensor, added into ``.grad``), plus, with fp32, the accumulate. A real
    micro-step's forward and backward come on top, in both.
``step``
    ``opt.step()`` after one such backward (with fp32 accumulation it unscales the fp32
    sum instead of copying the fp16 gradients into fp32 first).
``N micro-steps + step``
    ``zero_grad()``, ``--accum`` backward calls and ``step()``: a whole optimizer step
    of gradient handling, the first backward opening (zeroing) the fp32 sum.

Each row shows both options, their difference, the difference as a fraction of the
``None`` optimizer step, and, for ``accumulate``, the bytes it moves per fp16 parameter
(2 read, 4 + 4 for the fp32 sum, 2 written to zero the fp16 gradient: 12) against the
memory bandwidth measured in the same run (mpfp16.bench.step.memory_bandwidth), and,
for reference, the same arithmetic alone on one flat buffer (:func:`scratch_reference`).

Then ``opt.memory_bytes_per_param()`` for fused and unfused, with and without masters,
with each option, in the second step (the first made the inner optimizer's state):
after a backward (while a step's micro-batches accumulate) and between steps (after
``step()``). The fp32 sum is 4 bytes per 16-bit parameter; with
``fused=True`` and ``None`` there is no fp32 gradient buffer at all, and without masters
the fp32 buffers are freed after each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn as nn

from ..optimizer import FP16Optimizer
from ..parallel.accumulation import add_widened
from .step import LOSS_SCALE, OPTIMIZERS, compare, cpu_model, inner_optimizer, memory_bandwidth, model_params

ACCUMULATE_BYTES = 12  # per fp16 parameter: gradient read (2), fp32 sum read and written (8), gradient zeroed (2)
OPTIONS = {"None": None, "fp32": torch.float32}
MEMORY_KEYS = ("model_weights", "model_grads", "master_weights", "master_grads", "optimizer_state", "total")


class Holder:
    """An FP16Optimizer over fp16 copies of ``params`` (norms fp32), static loss scale,
    gradients already there."""

    def __init__(self, kind: str, params, accumulate_dtype, fused: bool, master_weights: bool = True) -> None:
        self.params = [nn.Parameter(p.detach().to(torch.float16 if half else torch.float32)) for p, half in params]
        self.opt = FP16Optimizer(inner_optimizer(kind, self.params), loss_scale=LOSS_SCALE, fused=fused,
                                 master_weights=master_weights, accumulate_dtype=accumulate_dtype)
        with torch.no_grad():
            for p in self.params:
                p.grad.copy_(torch.randn_like(p, dtype=torch.float32) * 1e-3 * LOSS_SCALE)
        self.n16 = sum(p.numel() for p in self.params if p.dtype == torch.float16)
        self.backward()  # opens the fp32 sum (gives it memory): store.accumulate() must never run before that


    def backward(self) -> None:
        """A backward that reaches every parameter and adds exactly zero to its gradient."""
        self.opt.backward(torch.stack([p.view(-1)[0].float() for p in self.params]).sum() * 0.0)

    def accumulate(self) -> None:
        state = self.opt._guard.state  # what opt.backward() does after its backward pass, alone
        self.opt.store.accumulate(first=not state.sums_open)  # after a step, a new sum: the step's first backward opens it
        state.sums_open = True

    def step(self) -> None:
        self.opt.step()

    def full_step(self, accum: int):
        def run() -> None:
            self.opt.zero_grad()
            for _ in range(accum):
                self.backward()
            self.opt.step()
        return run


def scratch_reference(numel: int):
    """The accumulate's arithmetic alone on one flat buffer, without the optimizer
    around it: :func:`mpfp16.parallel.accumulation.add_widened` (fp16 gradient into
    the fp32 sum, widened a chunk at a time), then the gradient zeroed."""
    grads = torch.zeros(numel, dtype=torch.float16)
    total = torch.zeros(numel)

    def run() -> None:
        add_widened(total, grads)
        grads.zero_()

    return run


def time_pair(kind: str, params, fused: bool, accum: int, rounds: int, warmup: int, device) -> dict:
    """Medians (seconds) of each piece for both options, timed alternately."""
    holders = {name: Holder(kind, params, dtype, fused) for name, dtype in OPTIONS.items()}
    methods = {"accumulate fp32": (None, holders["fp32"].accumulate),
               "scratch reference": (None, scratch_reference(holders["fp32"].n16))}
    for name, h in holders.items():
        methods[f"backward {name}"] = (None, h.backward)
        methods[f"step {name}"] = (h.backward, h.step)
        methods[f"full {name}"] = (None, h.full_step(accum))
    times = compare(methods, rounds, warmup, device)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["fused_used"] = {name: h.opt.fused for name, h in holders.items()}
    out["n16"] = holders["fp32"].n16
    return out


def memory_table(kind: str, params, fused_values) -> list[dict]:
    rows = []
    for fused in fused_values:
        for masters in (True, False):
            for name, dtype in OPTIONS.items():
                h = Holder(kind, params, dtype, fused, master_weights=masters)
                h.opt.step()  # the first step makes the inner optimizer's state: steady state from here
                h.opt.zero_grad()
                h.backward()
                during = h.opt.memory_bytes_per_param()
                h.opt.step()
                between = h.opt.memory_bytes_per_param()
                rows.append({"fused": fused, "master_weights": masters, "accumulate_dtype": name,
                             "fused_used": h.opt.fused, "after_backward": during, "between_steps": between})
                del h
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.2f}"


def print_times(model: str, fused: bool, r: dict, accum: int, bandwidth: float) -> list[dict]:
    ref_step = r["step None"]
    print(f"\n## {model}, {'fused' if fused else 'unfused'} step (used: None {r['fused_used']['None']}, "
          f"fp32 {r['fused_used']['fp32']}); {r['n16']:,} fp16 parameters")
    print(f"{'piece':<34}{'None ms':>10}{'fp32 ms':>10}{'fp32-None':>10}{'/ step None':>12}")
    rows = []
    for label, key, per in (("accumulate (per micro-step)", "accumulate", 1),
                            ("backward, no compute (per micro)", "backward", 1),
                            ("step", "step", 1),
                            (f"{accum} micro-steps + step", "full", 1)):
        none = 0.0 if key == "accumulate" else r[f"{key} None"]
        fp32 = r[f"{key} fp32"]
        rows.append({"piece": label, "none_ms": none * 1e3, "fp32_ms": fp32 * 1e3, "diff_ms": (fp32 - none) * 1e3,
                     "fraction_of_step_none": (fp32 - none) / ref_step})
        print(f"{label:<34}{_ms(none)}{_ms(fp32)}{_ms(fp32 - none)}{(fp32 - none) / ref_step:>12.3f}")
    gbps = ACCUMULATE_BYTES * r["n16"] / r["accumulate fp32"] / 1e9
    print(f"accumulate moves {ACCUMULATE_BYTES} B per fp16 parameter: {gbps:.1f} GB/s, "
          f"{gbps / bandwidth:.2f} of the {bandwidth:.1f} GB/s measured; "
          f"per optimizer step of {accum} micro-steps it adds "
          f"{(r['full fp32'] - r['full None']) * 1e3:.2f} ms "
          f"({(r['full fp32'] - r['full None']) / r['full None']:+.1%} of the None step's gradient handling)")
    print(f"for reference: the same arithmetic alone on one flat buffer (add_widened, then the gradient zeroed) "
          f"takes {r['scratch reference'] * 1e3:.2f} ms")
    return rows


def print_memory(model: str, rows: list[dict]) -> None:
    print(f"\n# {model}: opt.memory_bytes_per_param(), bytes per parameter")
    print(f"{'fused':<7}{'masters':<9}{'accumulate':<12}{'when':<16}" + "".join(f"{k:>16}" for k in MEMORY_KEYS))
    for r in rows:
        for when in ("after_backward", "between_steps"):
            report = r[when]
            print(f"{str(r['fused_used']):<7}{str(r['master_weights']):<9}{r['accumulate_dtype']:<12}"
                  f"{when.replace('_', ' '):<16}" + "".join(f"{report[k]:>16.2f}" for k in MEMORY_KEYS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,gpt2",
                        help="comma-separated: gpt2 or torchvision model names whose shapes to use "
                             "(default: resnet50,gpt2)")
    parser.add_argument("--fused", choices=("both", "on", "off"), default="both",
                        help="which FP16Optimizer steps to measure (default: both)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="the inner optimizer (default: sgd)")
    parser.add_argument("--accum", type=int, default=8, help="micro-steps per optimizer step (default: 8)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    parser.add_argument("--memory-models", default=None,
                        help="the models whose memory table is printed (default: the first of --models; "
                             "'none' for none)")
    parser.add_argument("--bandwidth-numel", type=int, default=1 << 25,
                        help="elements per fp32 buffer of the bandwidth measurement (default: 2^25, 128 MB)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's current count)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.accum < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--rounds, --accum and --threads must be >= 1 and --warmup >= 0")
    from ..train.models import imagenet_arch_names

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    memory_models = (models[:1] if args.memory_models is None else
                     [] if args.memory_models == "none" else [m.strip() for m in args.memory_models.split(",")])
    for m in models + memory_models:
        if m != "gpt2" and m not in imagenet_arch_names():
            parser.error(f"unknown model {m!r}: gpt2 or a torchvision model")
    if not models:
        parser.error("--models is empty")
    fused_values = {"both": (False, True), "on": (True,), "off": (False,)}[args.fused]
    device = torch.device("cpu")
    before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, models, memory_models, fused_values, device)
    finally:
        torch.set_num_threads(before)


def _run(args, models, memory_models, fused_values, device) -> int:
    bandwidth = memory_bandwidth(device, args.bandwidth_numel)
    limit = max(bandwidth.values())
    n = torch.get_num_threads()
    print(f"# accumulate_dtype=torch.float32 vs None; {args.optimizer}; cpu ({cpu_model()}), "
          f"{n} thread{'s' if n > 1 else ''}; median of {args.rounds} rounds; memory bandwidth "
          f"{bandwidth['copy']:.1f} GB/s copy, {bandwidth['triad']:.1f} GB/s triad")
    results = {"optimizer": args.optimizer, "threads": torch.get_num_threads(), "cpu": cpu_model(),
               "bandwidth_gb_per_s": bandwidth, "accum": args.accum, "times": [], "memory": {}}
    for model in models:
        params = model_params(model, device)
        for fused in fused_values:
            r = time_pair(args.optimizer, params, fused, args.accum, args.rounds, args.warmup, device)
            rows = print_times(model, fused, r, args.accum, limit)
            results["times"].append({"model": model, "fused": fused, "fused_used": r["fused_used"],
                                     "fp16_params": r["n16"], "rows": rows,
                                     "medians_ms": {k: v * 1e3 for k, v in r.items() if isinstance(v, float)}})
        if model in memory_models:
            mem = memory_table(args.optimizer, params, fused_values)
            print_memory(model, mem)
            results["memory"][model] = mem
        del params
    for model in memory_models:
        if model not in models:
            mem = memory_table(args.optimizer, model_params(model, device), fused_values)
            print_memory(model, mem)
            results["memory"][model] = mem
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
