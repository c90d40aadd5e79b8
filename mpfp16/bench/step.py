"""The optimizer step: mpfp16 against torch's fp32 step, torch.amp and an apex-style loop.

    python -m mpfp16.bench.step [--model resnet50] [--optimizer sgd|adamw|adam] [--json PATH]

Every method steps a parameter set with the shapes of a torchvision model (ResNet-50:
25.6M parameters in 161 tensors) from gradients that are already there; only the
step is timed. The methods run alternately, one step each per round, after warm-up
rounds (which also compile mpfp16's fused kernels); the table gives medians and each
method's ratio to torch's own fp32 step:

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
     writes, and kernels that read them.

It also reports the optimizer-side memory in bytes per parameter of each mpfp16 mode.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
import torch.nn as nn

from ..optimizer import FP16Optimizer
from .timing import time_call

LOSS_SCALE = 1024.0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_params(name: str, device: torch.device) -> list[nn.Parameter]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    return [nn.Parameter(p.detach().to(device)) for p in model.parameters()]


def inner_optimizer(kind: str, params, **kw) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4, **kw)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-3, weight_decay=1e-2 if kind == "adamw" else 1e-4, **kw)


def fp32_reference(kind: str, params):
    """a: torch's fastest fp32 step for the optimizer."""
    ps = [nn.Parameter(p.detach().clone()) for p in params]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = inner_optimizer(kind, ps, foreach=True) if kind == "sgd" else inner_optimizer(kind, ps, fused=True)
    return opt.step


def amp_grad_scaler(kind: str, params):
    """b: GradScaler over fp32 parameters (it refuses fp16 gradients). A scale of 1
    keeps the gradients the same from one round to the next."""
    ps = [nn.Parameter(p.detach().clone()) for p in params]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = inner_optimizer(kind, ps, foreach=True) if kind == "sgd" else inner_optimizer(kind, ps)
    scaler = torch.amp.GradScaler(ps[0].device.type, init_scale=1.0, growth_interval=1 << 30)
    scaler.scale(torch.ones((), device=ps[0].device))  # makes the scaler's scale tensor

    def step():
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return step


def apex_loop(kind: str, params):
    """c: the per-tensor master loop of apex's FP16_Optimizer."""
    model16 = [nn.Parameter(p.detach().half()) for p in params]
    for p in model16:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3 * LOSS_SCALE).half()
    masters = [nn.Parameter(p.detach().float()) for p in model16]
    opt = inner_optimizer(kind, masters, foreach=True) if kind == "sgd" else inner_optimizer(kind, masters)
    inv = 1.0 / LOSS_SCALE

    @torch.no_grad()
    def step():
        for p, m in zip(model16, masters):
            if m.grad is None:
                m.grad = torch.empty_like(m)
            m.grad.copy_(p.grad).mul_(inv)
            if not bool(torch.isfinite(m.grad).all()):
                return
        opt.step()
        for p, m in zip(model16, masters):
            p.copy_(m)

    return step


class _Mpfp16:
    """d/e/f: an FP16Optimizer over fp16 parameters with the given settings."""

    def __init__(self, kind: str, params, dtype=torch.float16, **kw) -> None:
        self.params = [nn.Parameter(p.detach().to(dtype)) for p in params]
        self.opt = FP16Optimizer(inner_optimizer(kind, self.params),
                                 loss_scale=LOSS_SCALE if dtype == torch.float16 else None, **kw)
        with torch.no_grad():
            for p in self.params:
                p.grad.copy_(torch.randn_like(p, dtype=torch.float32) * 1e-3 * LOSS_SCALE)

    def _touch(self) -> None:
        """A backward pass that reaches every parameter and adds exactly zero to its
        gradient, so that step() accepts the gradients as fresh (untimed)."""
        self.opt.backward(torch.stack([p.view(-1)[0].float() for p in self.params]).sum() * 0.0)

    def step(self) -> bool:
        return self.opt.step()

    def unscale_and_step(self) -> bool:
        self.opt.unscale_()
        return self.opt.step()


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="torchvision model whose shapes to use (default: resnet50)")
    parser.add_argument("--optimizer", choices=["sgd", "adamw", "adam"], default="sgd",
                        help="optimizer (default: sgd, momentum 0.9)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    from ..train.models import imagenet_arch_names

    if args.model not in imagenet_arch_names():
        parser.error(f"unknown torchvision model {args.model!r}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available")

    params = model_params(args.model, device)
    numel = sum(p.numel() for p in params)
    kind = args.optimizer
    fused16 = _Mpfp16(kind, params, fused=True)
    unfused16 = _Mpfp16(kind, params, fused=False)
    nomaster16 = _Mpfp16(kind, params, master_weights=False, fused=True)
    unscaled16 = _Mpfp16(kind, params, fused=True)
    a_name = f"a. torch fp32 {'SGD foreach' if kind == 'sgd' else kind + ' fused'}"
    methods = {
        a_name: (None, fp32_reference(kind, params)),
        "b. torch.amp GradScaler": (None, amp_grad_scaler(kind, params)),
        "c. apex-style loop": (None, apex_loop(kind, params)),
        "d. mpfp16 fp16+masters": (fused16._touch, fused16.step),
        "e. mpfp16 unfused": (unfused16._touch, unfused16.step),
        "f. mpfp16 no masters": (nomaster16._touch, nomaster16.step),
        "g. mpfp16 fused, unscale_()": (unscaled16._touch, unscaled16.unscale_and_step),
    }
    times = compare(methods, args.rounds, args.warmup, device)
    if not (fused16.opt.fused and nomaster16.opt.fused and unscaled16.opt.fused):
        print("warning: the fused path was not used (see the log line above)", file=sys.stderr)
    ref = statistics.median(times[a_name])
    rows = []
    print(f"# {args.model} shapes: {numel:,} parameters in {len(params)} tensors; {kind}; {device.type}"
          f" ({cpu_model() if device.type == 'cpu' else torch.cuda.get_device_name(device)}); "
          f"{torch.get_num_threads()} threads; median of {args.rounds} rounds")
    print(f"{'method':<34}{'ms':>9}{'vs a':>8}")
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append({"method": name, "median_ms": t * 1e3, "ratio": t / ref})
        print(f"{name:<34}{t * 1e3:>9.2f}{t / ref:>8.2f}")

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
    print("\n# optimizer-side memory between steps, bytes per parameter")
    keys = ["model_weights", "model_grads", "master_weights", "master_grads", "optimizer_state", "total"]
    print(f"{'mode':<32}" + "".join(f"{k:>16}" for k in keys))
    for mode, report in memory.items():
        print(f"{mode:<32}" + "".join(f"{report[k]:>16.2f}" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "numel": numel, "tensors": len(params), "optimizer": kind,
                       "device": device.type, "cpu": cpu_model(), "threads": torch.get_num_threads(),
                       "rows": rows, "memory_bytes_per_param": memory}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
