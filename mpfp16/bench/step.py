"""The optimizer step: mpfp16 against torch's fp32 step, torch.amp and an apex-style
loop, each as time, as memory traffic, and as a fraction of this machine's memory
bandwidth measured in the same run.

    python -m mpfp16.bench.step [--model resnet50|gpt2|NAME] [--optimizer sgd|sgd-nowd|adamw|adam]
                                [--threads 1,2] [--skipped] [--remainder] [--state-dtype] [--json PATH]

Every method steps a parameter set with the shapes of a model (a torchvision model by
name, ResNet-50 by default: 25.6M parameters in 161 tensors; or ``gpt2``, GPT-2
small: 124.4M parameters in 148 tensors, tied embeddings, mpfp16/train/gpt.py) from
gradients that are already there; only the step is timed. Before each step, every
method gets the same untimed backward pass, one that reaches every parameter and adds
exactly zero to its gradient: training's backward writes every gradient before a step,
and a step's speed depends on what that leaves in the caches (the fp32 methods had none
before 2026-12-02, the 16-bit ones, which need it for ``step()`` to accept the
gradients, did). Normalization layers' parameters stay fp32 in the 16-bit methods, as
``to_half`` keeps them. The methods run alternately, one step each per round, after
warm-up rounds (which also compile mpfp16's fused kernels); the table gives medians and
each method's ratio to torch's own fp32 step:

  a. torch fp32: SGD-momentum with foreach=True, or Adam/AdamW with fused=True;
  b. torch.amp: GradScaler.unscale_ + step + update over fp32 parameters;
  c. apex-style loop: per tensor, copy the fp16 gradient into the fp32 master, unscale,
     check for inf/NaN (one host sync per tensor), then the fp32 step, then per tensor
     copy the master back into the fp16 weight;
  d. mpfp16 FP16Optimizer.step() (fused path) over fp16 weights with fp32 masters;
  e. the same with fused=False (the inner optimizer steps per-tensor master views);
  f. mpfp16 without master weights (fused);
  g. d with ``unscale_()`` called before ``step()`` (the order of a user who clips
     with their own function): the fp32 gradients the fused step otherwise never
     writes, and kernels that read them;
  n. the guard of the state's one owner alone, as d's first phase runs it: that the
     inner optimizer's state is still the tensors the kernels step and its groups still
     ones they can step (mpfp16/stores/flat_state.py), printed as a share of d.

With ``--skipped``, two more rows, and the cost of the loss flag ``opt.backward()``
records (docs/OVERFLOW.md):

  h. d's step when a gradient holds one inf: the step is skipped, and
     ``opt.last_overflow`` names the parameter (the scan runs on skipped steps only);
  i. that scan alone (``store.nonfinite_grads``), the part of h a clean step never runs.

With ``--remainder``, bf16 side by side (docs/REMAINDER.md), both fused:

  j. bf16 weights with fp32 masters;
  k. bf16 weights with ``master_weights="remainder"``: the fp32 masters held as the
     weights and an int16 remainder each, rebuilt and split again inside the kernel.

**The limit.** Before the methods, for each thread count, the run measures the roofline
of :mod:`mpfp16.bench.roofline` over buffers of the model's parameter count: a copy and
a triad, one compiled pass with each fused kernel's own streams (the same dtypes read,
updated in place and written, an average per element), and torch's fused fp32 AdamW (7
streams, achievable by definition); the best GB/s is the limit. Each method's row then gives the bytes per
parameter it moves (``TRAFFIC``: every pass it makes, reads plus writes, as counted
below), the GB/s that makes at its median time, and the fraction of the limit: at most
1, up to noise, for a method that moves what ``TRAFFIC`` says.

It also reports the optimizer-side memory in bytes per parameter of each mpfp16 mode.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Callable

import torch
import torch.nn as nn

from ..convert import NORM_TYPES
from ..optimizer import FP16Optimizer
from ..scaler import LossScaler
from . import roofline
from .timing import Timer, time_call

LOSS_SCALE = 1024.0
OPTIMIZERS = ("sgd", "sgd-nowd", "adamw", "adam")


def _torch_step_bytes(kind: str, fused: bool) -> int:
    """Bytes per parameter of torch's own fp32 step (foreach and for-loop alike make
    the same passes). SGD-momentum: [weight decay: g = g + wd * p, 12] buf *= m (8),
    buf += g (12), p -= lr * buf (12). Adam/AdamW: [Adam: g = g + wd * p, 12; AdamW:
    p *= 1 - lr * wd, 8] exp_avg.lerp_ (12), exp_avg_sq *= b2 (8), += (1 - b2) g^2 (12),
    sqrt (8), / bias correction (8), + eps (8), p.addcdiv_ (16). Fused Adam/AdamW: one
    pass, p, g, exp_avg, exp_avg_sq read and p and both moments written (28)."""
    if kind.startswith("sgd"):
        return 32 + (12 if kind == "sgd" else 0)
    if fused:
        return 28
    return 12 + 12 + 20 + 24 + 16 - (4 if kind == "adamw" else 0)


def traffic(kind: str) -> dict[str, int]:
    """Bytes per parameter each method moves through memory, pass by pass.

    a. torch's step: SGD foreach, or fused Adam/AdamW (``_torch_step_bytes``).
    b. GradScaler's unscale_ reads and writes the fp32 gradients (8), then torch's step.
    c. apex loop: fp16 grad -> fp32 (2 + 4), unscale in place (8), isfinite + all
       (4 + 1 + 1), torch's step on the masters, master -> fp16 weight (4 + 2).
    d. mpfp16 fused: the overflow check reads the fp16 gradients (2); the kernel reads
       the fp16 gradient and the fp32 master and state and writes them and the fp16
       weight (SGD-momentum: 2 + 4 + 4 read, 4 + 4 + 2 written = 20; Adam: 28).
    e. mpfp16 unfused: fp16 grad -> fp32 (6), unscale and check in one pass (8),
       torch's for-loop step on the masters, master -> fp16 weight (6).
    f. no masters: check (2), the kernel reads the fp16 weight for the fp32 master
       (SGD: 2 + 2 + 4 read, 4 + 2 written = 14; Adam: 22), in one pass (on CPU, the
       native kernel's; only stochastic and Kahan rounding, not timed here, take two
       passes for Adam's coupled weight decay there).
    g. d after unscale_(): fp16 grad -> fp32 plus unscale and check (14), the kernel
       reads the fp32 gradient (2 more than d's).
    h. a skipped step: the check (2), the overflow scan (2), zero_grad writes (2).
    i. the overflow scan alone: its largest magnitude per tensor reads the fp16
       gradients (2; the counts of the one tensor flagged are not counted).
    j. bf16 with fp32 masters: as d.
    k. bf16 with remainders: as j, but the kernel reads the weight and its remainder
       (2 + 2) for the master (4), and writes them (2 + 2) for the master and the
       weight (4 + 2): 2 bytes less (one pass for Adam too: its weight decay needs
       the master).
    l. d with bf16 states (``state_dtype=torch.bfloat16``): the states read and written
       in 2 bytes where d's take 4 (SGD: 2 + 16 = 18; Adam: 2 + 20 = 22).
    m. f with bf16 states (SGD: 2 + 10 = 12; Adam: 2 + 14 = 16).
    n. the guard of the state's one owner alone (``LocalStore.check_state``: the inner
       optimizer's state still the tensors the kernels step, checked by identity before
       anything moves, mpfp16/stores/flat_state.py): it reads no tensor (0).
    """
    sgd = kind.startswith("sgd")
    torch_step = _torch_step_bytes(kind, fused=False)
    fused_kernel = 20 if sgd else 28
    return {
        "a": _torch_step_bytes(kind, fused=not sgd),
        "b": 8 + torch_step,
        "c": 6 + 8 + 6 + torch_step + 6,
        "d": 2 + fused_kernel,
        "e": 14 + torch_step + 6,
        "f": 2 + fused_kernel - 6,
        "g": 14 + fused_kernel + 2,
        "h": 2 + 2 + 2,
        "i": 2,
        "j": 2 + fused_kernel,
        "k": 2 + fused_kernel - 2,
        "l": 2 + fused_kernel - (4 if sgd else 8),
        "m": 2 + fused_kernel - 6 - (4 if sgd else 8),
        "n": 0,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_params(name: str, device: torch.device) -> list[tuple[nn.Parameter, bool]]:
    """(fp32 parameter, whether the 16-bit methods make it 16-bit) for each parameter
    of the model: normalization layers' parameters stay fp32, as ``to_half`` keeps them."""
    torch.manual_seed(0)
    if name == "gpt2":
        from ..train.gpt import build_gpt

        model = build_gpt("gpt2")
    else:
        import torchvision

        model = torchvision.models.get_model(name, weights=None)
    kept = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters(recurse=False)}
    return [(nn.Parameter(p.detach().to(device)), id(p) not in kept) for p in model.parameters()]


def inner_optimizer(kind: str, params, **kw) -> torch.optim.Optimizer:
    if kind.startswith("sgd"):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4 if kind == "sgd" else 0.0, **kw)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-3, weight_decay=1e-2 if kind == "adamw" else 1e-4, **kw)


def _fp32_copies(params) -> list[nn.Parameter]:
    ps = [nn.Parameter(p.detach().clone()) for p, _ in params]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def _zero_loss(ps) -> torch.Tensor:
    """A loss whose backward reaches every parameter of ``ps`` and adds exactly zero to
    its gradient."""
    return torch.stack([p.view(-1)[0].float() for p in ps]).sum() * 0.0


def zero_backward(ps) -> Callable[[], None]:
    """The untimed backward before each step of a method (plain ``backward()``; mpfp16's
    methods run the same loss through ``opt.backward``, ``_Mpfp16._touch``)."""
    return lambda: _zero_loss(ps).backward()


def fp32_reference(kind: str, params):
    """a: torch's fastest fp32 step for the optimizer; (its backward, its step)."""
    ps = _fp32_copies(params)
    opt = inner_optimizer(kind, ps, foreach=True) if kind.startswith("sgd") else inner_optimizer(kind, ps, fused=True)
    return zero_backward(ps), opt.step


def amp_grad_scaler(kind: str, params):
    """b: GradScaler over fp32 parameters (it refuses fp16 gradients). A scale of 1
    keeps the gradients the same from one round to the next. (Its backward, its step.)"""
    ps = _fp32_copies(params)
    opt = inner_optimizer(kind, ps, foreach=True) if kind.startswith("sgd") else inner_optimizer(kind, ps)
    scaler = torch.amp.GradScaler(ps[0].device.type, init_scale=1.0, growth_interval=1 << 30)
    scaler.scale(torch.ones((), device=ps[0].device))  # makes the scaler's scale tensor

    def step():
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return zero_backward(ps), step


def apex_loop(kind: str, params):
    """c: the per-tensor master loop of apex's FP16_Optimizer (fp32 parameters are
    their own masters, as in apex's fp32_from_fp32 groups). (Its backward, its step.)"""
    model16 = [nn.Parameter(p.detach().half() if half else p.detach().clone()) for p, half in params]
    for p in model16:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3 * LOSS_SCALE).to(p.dtype)
    masters = [nn.Parameter(p.detach().float()) if p.dtype != torch.float32 else p for p in model16]
    opt = inner_optimizer(kind, masters, foreach=True) if kind.startswith("sgd") else inner_optimizer(kind, masters)
    inv = 1.0 / LOSS_SCALE

    @torch.no_grad()
    def step():
        for p, m in zip(model16, masters):
            if m is p:
                p.grad.mul_(inv)  # undone below, so that every round sees the same gradients
            else:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad).mul_(inv)
            if not bool(torch.isfinite(m.grad).all()):
                return
        opt.step()
        for p, m in zip(model16, masters):
            if m is p:
                p.grad.mul_(LOSS_SCALE)
            else:
                p.copy_(m)

    return zero_backward(model16), step


class _Mpfp16:
    """d/e/f/g: an FP16Optimizer over 16-bit parameters (norms fp32) with the given settings."""

    def __init__(self, kind: str, params, dtype=torch.float16, **kw) -> None:
        self.params = [nn.Parameter(p.detach().to(dtype if half else torch.float32)) for p, half in params]
        kw.setdefault("loss_scale", LOSS_SCALE if dtype == torch.float16 else None)
        self.opt = FP16Optimizer(inner_optimizer(kind, self.params), **kw)
        scale = LOSS_SCALE if dtype == torch.float16 else 1.0
        with torch.no_grad():
            for p in self.params:
                p.grad.copy_(torch.randn_like(p, dtype=torch.float32) * 1e-3 * scale)

    def _touch(self) -> None:
        """A backward pass that reaches every parameter and adds exactly zero to its
        gradient, so that step() accepts the gradients as fresh (untimed)."""
        self.opt.backward(_zero_loss(self.params))

    def step(self) -> bool:
        return self.opt.step()

    def unscale_and_step(self) -> bool:
        self.opt.unscale_()
        return self.opt.step()

    def before_guard(self) -> None:
        """What d's step does before the guard (untimed): the backward, then the first
        phase's check that every parameter is still where the step wrote it."""
        self._touch()
        for g in self.opt.store.groups:
            g.check_params()

    def check_state(self) -> None:
        """The guard of the state's one owner alone, as the step's first phase runs it (n)."""
        self.opt.store.check_state()


class _Skipping(_Mpfp16):
    """h/i: d, with one inf in the gradient of its last 16-bit parameter: every step
    is skipped (a static scale that never declares itself stuck)."""

    def __init__(self, kind: str, params) -> None:
        super().__init__(kind, params, fused=True, loss_scale=LossScaler(LOSS_SCALE, stuck_after=1 << 30))
        self.culprit = max(i for i, (_, half) in enumerate(params) if half)
        self.poison()

    def poison(self) -> None:
        """A backward pass (untimed), then the inf."""
        self._touch()
        with torch.no_grad():
            self.params[self.culprit].grad.view(-1)[0] = float("inf")

    def skipped_step(self) -> None:
        if self.opt.step() or self.opt.last_overflow[0]["count"] != 1:
            raise RuntimeError("the step with an inf gradient was not skipped with one culprit")

    def scan(self) -> None:
        self.opt.report_overflow(before_unscale=True)


def loss_flag_us(device: torch.device, calls: int = 2000) -> float:
    """Microseconds of what ``opt.backward()`` adds to each backward pass for
    ``last_overflow``, for a scalar loss: ``isfinite(loss)``, and-ed into the step's
    flag (from a step's second backward on, accumulation micro-batches), left on the
    device (no host synchronization), median of ``calls``."""
    loss = torch.ones((), device=device, requires_grad=True) * 2.0
    flag = torch.isfinite(loss.detach())
    times = []
    for _ in range(calls):
        with Timer(device) as t:
            flag = flag & torch.isfinite(loss.detach())
        times.append(t.seconds)
    return statistics.median(times) * 1e6


def compare(methods: dict, rounds: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    times = {name: [] for name in methods}
    for i in range(warmup + rounds):
        for name, (prepare, step) in methods.items():
            if prepare is not None:
                prepare()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time_call(step, device)
            if i >= warmup:
                times[name].append(seconds)
    return times


def memory_bandwidth(device: torch.device, numel: int, rounds: int = 5) -> dict[str, float]:
    """GB/s of a copy and a triad over fp32 buffers of ``numel`` elements, best of
    ``rounds`` (the first touch of the buffers is not timed): two or three streams,
    the limit of mpfp16.bench.accumulation's passes. The step's own limit is
    :func:`mpfp16.bench.roofline.measure`."""
    return roofline.measure(device, numel, rounds, shapes={}, torch_adamw=False)


def _thread_counts(text: str) -> list[int]:
    counts = [int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise ValueError
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50",
                        help="gpt2, or a torchvision model whose shapes to use (default: resnet50)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="sgd: momentum 0.9, weight decay 1e-4; sgd-nowd: the same without weight decay; "
                             "adamw; adam (default: sgd)")
    parser.add_argument("--threads", default=None, metavar="N[,N...]",
                        help="torch thread counts to measure, one table each (default on CPU: 1,2 where the "
                             "machine has 2 cores or more; on CUDA: the current count)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--bandwidth-numel", type=int, default=None,
                        help="elements per buffer of the roofline kernels (default: the model's parameter count)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    parser.add_argument("--skipped", action="store_true",
                        help="also time a skipped step (one inf in one gradient) and its overflow scan alone (h, i), "
                             "and the loss flag opt.backward() records")
    parser.add_argument("--state-dtype", action="store_true",
                        help="also time d and f with bf16 optimizer states (state_dtype=torch.bfloat16) (l, m)")
    parser.add_argument("--remainder", action="store_true",
                        help="also time bf16 with fp32 masters and with master_weights='remainder' side by side (j, k)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    if args.bandwidth_numel is not None and args.bandwidth_numel < 1:
        parser.error("--bandwidth-numel must be >= 1")
    from ..train.models import imagenet_arch_names

    if args.model != "gpt2" and args.model not in imagenet_arch_names():
        parser.error(f"unknown model {args.model!r}: gpt2 or a torchvision model")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available")
    try:
        threads = (_thread_counts(args.threads) if args.threads is not None
                   else [1, 2] if device.type == "cpu" and torch.get_num_threads() >= 2 else [torch.get_num_threads()])
    except ValueError:
        parser.error(f"--threads must be positive integers separated by commas, got {args.threads!r}")

    params = model_params(args.model, device)
    numel = sum(p.numel() for p, _ in params)
    kind = args.optimizer
    fused16 = _Mpfp16(kind, params, fused=True)
    unfused16 = _Mpfp16(kind, params, fused=False)
    nomaster16 = _Mpfp16(kind, params, master_weights=False, fused=True)
    unscaled16 = _Mpfp16(kind, params, fused=True)
    a_name = f"a. torch fp32 {'SGD foreach' if kind.startswith('sgd') else kind + ' fused'}"
    methods = {
        a_name: fp32_reference(kind, params),
        "b. torch.amp GradScaler": amp_grad_scaler(kind, params),
        "c. apex-style loop": apex_loop(kind, params),
        "d. mpfp16 fp16+masters": (fused16._touch, fused16.step),
        "e. mpfp16 unfused": (unfused16._touch, unfused16.step),
        "f. mpfp16 no masters": (nomaster16._touch, nomaster16.step),
        "g. mpfp16 fused, unscale_()": (unscaled16._touch, unscaled16.unscale_and_step),
    }
    if args.skipped:
        skipping16, scanned16 = _Skipping(kind, params), _Skipping(kind, params)
        methods["h. d skipped (1 inf), named"] = (skipping16.poison, skipping16.skipped_step)
        methods["i. h's overflow scan alone"] = (None, scanned16.scan)
    if args.remainder:
        bf16_masters = _Mpfp16(kind, params, dtype=torch.bfloat16, fused=True)
        bf16_held = _Mpfp16(kind, params, dtype=torch.bfloat16, fused=True, master_weights="remainder")
        methods["j. bf16 + fp32 masters"] = (bf16_masters._touch, bf16_masters.step)
        methods["k. bf16, remainder masters"] = (bf16_held._touch, bf16_held.step)
    if args.state_dtype:
        bf16_states = _Mpfp16(kind, params, fused=True, state_dtype=torch.bfloat16)
        bf16_states_nomaster = _Mpfp16(kind, params, master_weights=False, fused=True, state_dtype=torch.bfloat16)
        methods["l. d, bf16 states"] = (bf16_states._touch, bf16_states.step)
        methods["m. f, bf16 states"] = (bf16_states_nomaster._touch, bf16_states_nomaster.step)
    methods["n. d's state guard alone"] = (fused16.before_guard, fused16.check_state)
    bytes_per_param = traffic(kind)
    where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"# {args.model} shapes: {numel:,} parameters in {len(params)} tensors; {kind}; {device.type} ({where}); "
          f"median of {args.rounds} rounds")
    results = []
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            bandwidth = roofline.measure(device, args.bandwidth_numel or numel)
            limit = max(bandwidth.values())
            times = compare(methods, args.rounds, args.warmup, device)
            ref = statistics.median(times[a_name])
            rows = []
            print(f"\n## {n} thread{'s' if n > 1 else ''}: the roofline (one pass per kernel, buffers of "
                  f"{args.bandwidth_numel or numel:,} elements, GB/s):")
            for name, gbps in bandwidth.items():
                print(f"  {name:<40}{gbps:>8.1f}{'  <- the limit' if gbps == limit else ''}")
            print(f"{'method':<34}{'ms':>9}{'vs a':>8}{'B/param':>9}{'GB/s':>8}{'of limit':>10}")
            for name, ts in times.items():
                t = statistics.median(ts)
                moved = bytes_per_param[name[0]]
                gbps = moved * numel / t / 1e9
                rows.append({"method": name, "median_ms": t * 1e3, "ratio": t / ref, "bytes_per_param": moved,
                             "gb_per_s": gbps, "fraction_of_limit": gbps / limit})
                print(f"{name:<34}{t * 1e3:>9.2f}{t / ref:>8.2f}{moved:>9d}{gbps:>8.1f}{gbps / limit:>10.2f}")
            n_d = (statistics.median(times["n. d's state guard alone"])
                   / statistics.median(times["d. mpfp16 fp16+masters"]))
            print(f"n / d (the guard of the state's one owner, in d's step): {100 * n_d:.2f}%")
            if args.remainder:
                k, j = (statistics.median(times[name]) for name in ("k. bf16, remainder masters",
                                                                    "j. bf16 + fp32 masters"))
                print(f"k / j (remainder against fp32 masters, bf16): {k / j:.3f}")
            results.append({"threads": n, "bandwidth_gb_per_s": bandwidth, "limit_gb_per_s": limit, "rows": rows,
                            "state_guard_over_d": n_d})
    finally:
        torch.set_num_threads(before)
    bf16_fused = not args.remainder or (bf16_masters.opt.fused and bf16_held.opt.fused)
    if not (fused16.opt.fused and nomaster16.opt.fused and unscaled16.opt.fused and bf16_fused):
        print("warning: the fused path was not used (see the log line above)", file=sys.stderr)
    flag_us = None
    if args.skipped:
        flag_us = loss_flag_us(device)
        print(f"\nopt.backward()'s loss flag for last_overflow (isfinite(loss), and-ed, no host sync): "
              f"{flag_us:.1f} us per backward pass")

    bf16 = _Mpfp16(kind, params, dtype=torch.bfloat16, fused=True)
    for holder in (fused16, unfused16, nomaster16, bf16):
        holder._touch()
        holder.step()
    memory = {
        "fp16 + fp32 masters (fused)": fused16.opt.memory_bytes_per_param(),
        "fp16 + fp32 masters (unfused)": unfused16.opt.memory_bytes_per_param(),
        "fp16, no masters (fused)": nomaster16.opt.memory_bytes_per_param(),
        "bf16 + fp32 masters (fused)": bf16.opt.memory_bytes_per_param(),
    }
    if args.remainder:
        bf16_held._touch()
        bf16_held.step()
        memory["bf16, remainder masters (fused)"] = bf16_held.opt.memory_bytes_per_param()
    print("\n# optimizer-side memory between steps, bytes per parameter")
    keys = ["model_weights", "model_grads", "master_weights", "master_grads", "optimizer_state", "total"]
    if args.remainder:
        keys.insert(-1, "master_remainder")
    print(f"{'mode':<32}" + "".join(f"{k:>16}" for k in keys))
    for mode, report in memory.items():
        print(f"{mode:<32}" + "".join(f"{report[k]:>16.2f}" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "numel": numel, "tensors": len(params), "optimizer": kind,
                       "device": device.type, "cpu": cpu_model(), "results": results,
                       "memory_bytes_per_param": memory, "loss_flag_us": flag_us}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
