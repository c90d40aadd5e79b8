"""Sharded masters (FSDP2) against the DDP path: the same trajectory, and the memory.

    torchrun --nproc_per_node 2 -m mpfp16.bench.sharding trajectory [--steps 100] [--json PATH] [--plot PATH]
    python -m mpfp16.bench.sharding memory [--ranks 1,2,4] [--model resnet50] [--json PATH]

``trajectory`` trains one small ResNet (resnet9 of width 8, BatchNorm, on the embedded
CIFAR-shaped images, batch 8 per rank, SGD with momentum and weight decay, clipping
at 1.0 unless ``--clip 0``, dynamic loss scaling) twice in the same process group, on the same data: once as an fp16
model with fp32 masters under DDP (``to_half``, ``wrap``), once sharded
(``shard``), and prints the loss of each step, the steps each run skipped (one
rank's batch holds a NaN at ``--nan-steps``, and the first steps overflow at the
initial scale), and the largest difference between the two runs' fp32 masters; and
a third run for the scale of rounding differences: the unsharded run again, its learning
rate one fp32 ulp higher.

``memory`` launches ``torchrun --nproc_per_node N`` for each N of ``--ranks`` and
reports, per rank, the bytes per parameter held between steps
(``FP16Optimizer.memory_bytes_per_param``, measured from the storages of the
tensors held after one step) with SGD (momentum) and Adam, for the DDP path (the
unfused and the fused step) and the sharded one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import distributed as mdist
from ..convert import to_half
from ..errors import last_error_line
from ..optimizer import FP16Optimizer

MODES = ("ddp", "sharded")
BASELINE = "ddp, lr + 1 ulp"


def tiny_model(width: int = 8) -> nn.Module:
    from ..train.models import resnet9

    return resnet9(width=width, num_classes=10)


def build(mode: str, model: nn.Module, optimizer: str = "sgd", clip: float | None = 1.0, fused: bool | None = False,
          lr: float = 0.05, reduce_dtype: torch.dtype | None = None, predivide: float = 1.0,
          loss_scale="dynamic", reshard_after_forward: bool = True):
    """(module to call, FP16Optimizer) for ``mode``: ``"ddp"`` (fp16 model with fp32
    masters, mpfp16's DDP) or ``"sharded"`` (:func:`mpfp16.distributed.shard`)."""
    if mode == "ddp":
        to_half(model)
        params = model.parameters()
    else:
        model = mdist.shard(model, reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward)
        params = model.parameters()
        fused = None
    if optimizer == "sgd":
        inner = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    else:
        inner = torch.optim.Adam(params, lr=lr * 0.02)
    opt = FP16Optimizer(inner, loss_scale=loss_scale, max_grad_norm=clip, track_grad_norm=True, model=model,
                        fused=fused)
    if mode == "ddp" and dist.get_world_size() > 1:
        return mdist.wrap(model, predivide_factor=predivide), opt, model
    return model, opt, model


_DATA: dict = {}


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable set of 2048 images (the embedded CIFAR-shaped data), normalized."""
    if seed not in _DATA:
        from ..train.data import synthetic_images

        images, labels = synthetic_images(2048, 32, 10, seed=seed)
        _DATA[seed] = ((images.float() / 255 - 0.5) / 0.25, labels)
    return _DATA[seed]


def batch(step: int, micro: int, per_rank: int, seed: int, nan: bool):
    """This rank's slice of the global batch of ``step`` (drawn from :func:`_data`);
    with ``nan``, rank 1's (or the only rank's) first image is NaN."""
    world, rank = dist.get_world_size(), dist.get_rank()
    images, labels = _data(seed)
    g = torch.Generator().manual_seed(seed * 100003 + step * 101 + micro)
    index = torch.randint(0, len(labels), (per_rank * world,), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    x, y = images[index], labels[index]
    if nan and rank == min(1, world - 1):
        x = x.clone()
        x[0, 0, 0, 0] = float("nan")
    return x, y


def masters(mode: str, model: nn.Module, opt: FP16Optimizer) -> dict[str, torch.Tensor]:
    """The fp32 masters by parameter name, whole (gathered from the shards)."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for p, m in zip(opt.model_params(), opt.master_params()):
        out[names[id(p)]] = (m.full_tensor() if mode == "sharded" else m).detach().float().cpu().clone()
    return out


def trajectory(mode: str, steps: int, seed: int = 0, per_rank: int = 8, accum: int = 1, nan_steps=(),
               optimizer: str = "sgd", width: int = 8, reduce_dtype: torch.dtype | None = None,
               clip: float | None = 1.0, predivide: float = 1.0, lr: float = 0.05,
               reshard_after_forward: bool = True) -> dict:
    """Train ``steps`` steps in ``mode`` in the current process group; every rank
    returns the same record: losses (mean over ranks), skipped steps, scales, norms,
    and the masters at the end."""
    torch.manual_seed(seed)
    call, opt, model = build(mode, tiny_model(width), optimizer, clip=clip, reduce_dtype=reduce_dtype,
                             predivide=predivide, lr=lr, reshard_after_forward=reshard_after_forward)
    losses, skipped, scales, norms = [], [], [], []
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        for micro in range(accum):
            x, y = batch(step, micro, per_rank, seed, nan=step in nan_steps and micro == 0)
            with mdist.sync_gradients(call, micro == accum - 1):
                loss = nn.functional.cross_entropy(call(x).float(), y)
                opt.backward(loss / accum)
            total += loss.detach() / accum
        scales.append(opt.loss_scale)
        if not opt.step():
            skipped.append(step)
        norms.append(opt.last_grad_norm)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return {"mode": mode, "losses": losses, "skipped": skipped, "scales": scales, "grad_norms": norms,
            "masters": masters(mode, model, opt),
            "buffers": {name: b.detach().clone() for name, b in model.named_buffers()}}


def compare(a: dict, b: dict) -> dict:
    """Largest master difference and how many masters are bit-identical."""
    diffs = {name: (a["masters"][name] - b["masters"][name]).abs().max().item() for name in a["masters"]}
    worst = max(diffs, key=diffs.get)
    scale = max(a["masters"][worst].abs().max().item(), 1e-30)
    loss_diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]) if x == x and y == y)
    return {"max_master_diff": diffs[worst], "max_master_diff_relative": diffs[worst] / scale, "worst": worst,
            "identical_masters": sum(d == 0 for d in diffs.values()), "masters": len(diffs),
            "max_loss_diff": loss_diff, "same_skips": a["skipped"] == b["skipped"]}


PATHS = {"ddp": ("ddp", False), "ddp-fused": ("ddp", True), "sharded": ("sharded", None)}


def memory_rows(model_name: str, optimizers=("sgd", "adam"), paths=tuple(PATHS), image_size: int = 64) -> list[dict]:
    """Bytes per parameter held by this rank after one step that was not skipped
    (the dynamic scale backs off first), for each path."""
    rows = []
    for optimizer in optimizers:
        for mode, fused in (PATHS[p] for p in paths):
            torch.manual_seed(0)
            call, opt, model = build(mode, _memory_model(model_name), optimizer, clip=None, fused=fused)
            # ResNet-50's last BatchNorms see 2x2 positions per image at 64px: with 2 images at 32px
            # (1x1) their fp16 backward overflows whatever the scale.
            x = torch.randn(4, 3, image_size, image_size)
            y = torch.randint(0, 10, (4,))
            for _ in range(30):
                opt.zero_grad()
                opt.backward(nn.functional.cross_entropy(call(x).float(), y))
                if opt.step():
                    break
            else:
                raise RuntimeError(f"{mode} {optimizer}: every step overflowed (loss scale {opt.loss_scale:g})")
            rows.append({"ranks": dist.get_world_size(), "optimizer": optimizer,
                         "path": {False: "ddp (unfused)", True: "ddp (fused)", None: "sharded"}[fused],
                         "params": sum(p.numel() for p in model.parameters()), **opt.memory_bytes_per_param()})
            del call, opt, model
    return rows


def _memory_model(name: str) -> nn.Module:
    if name.startswith("resnet9"):  # resnet9 or resnet9-wN
        return tiny_model(int(name.partition("-w")[2] or 64))
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=1000)


def table(rows: list[dict]) -> str:
    keys = ("model_weights", "model_grads", "master_weights", "master_grads", "optimizer_state", "total")
    lines = ["| ranks | optimizer | path | " + " | ".join(keys) + " |", "|" + "---|" * (3 + len(keys))]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["ranks"], r["path"])):
        lines.append(f"| {r['ranks']} | {r['optimizer']} | {r['path']} | " +
                     " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def _run_trajectory(args) -> int:
    info = mdist.init(backend="gloo", device="cpu")
    try:
        if not info.distributed:
            print("trajectory runs under torchrun (torchrun --nproc_per_node 2 -m mpfp16.bench.sharding "
                  "trajectory)", file=sys.stderr)
            return 2
        nan_steps = tuple(args.nan_steps)
        runs = {mode: trajectory(mode, args.steps, args.seed, args.batch_size, args.accum, nan_steps,
                                 args.optimizer, args.width, clip=args.clip or None) for mode in MODES}
        result = compare(runs["ddp"], runs["sharded"])
        # The scale of rounding differences: the unsharded run again, its learning rate one fp32 ulp higher.
        lr = torch.nextafter(torch.tensor(0.05, dtype=torch.float32), torch.tensor(1.0)).item()
        runs[BASELINE] = trajectory("ddp", args.steps, args.seed, args.batch_size, args.accum, nan_steps,
                                    args.optimizer, args.width, clip=args.clip or None, lr=lr)
        result["baseline"] = compare(runs["ddp"], runs[BASELINE])
        if info.rank == 0:
            print(f"{args.steps} steps, {info.world_size} ranks, batch {args.batch_size} per rank x {args.accum}, "
                  f"{args.optimizer}, clipping at {args.clip or 'none'}, NaN batches at steps {list(nan_steps)}")
            print(f"skipped steps: ddp {runs['ddp']['skipped']}, sharded {runs['sharded']['skipped']} "
                  f"({'the same' if result['same_skips'] else 'DIFFERENT'})")
            print(f"largest master difference: {result['max_master_diff']:.3g} ({result['worst']}, "
                  f"{result['max_master_diff_relative']:.3g} of its largest value); {result['identical_masters']} of "
                  f"{result['masters']} masters bit-identical; largest loss difference {result['max_loss_diff']:.3g}")
            if "baseline" in result:
                b = result["baseline"]
                print(f"baseline, ddp against ddp with its learning rate one fp32 ulp higher: largest master "
                      f"difference {b['max_master_diff']:.3g} ({b['worst']}, {b['max_master_diff_relative']:.3g} of "
                      f"its largest value); largest loss difference {b['max_loss_diff']:.3g}")
            for step in range(0, args.steps, max(1, args.steps // 10)):
                print(f"  step {step:4d}: loss ddp {runs['ddp']['losses'][step]:.6f}  sharded "
                      f"{runs['sharded']['losses'][step]:.6f}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"world_size": info.world_size, "steps": args.steps, **result,
                               **{mode: {k: v for k, v in run.items() if k not in ("masters", "buffers")}
                                  for mode, run in runs.items()}},
                              f, indent=1)
            if args.plot:
                _plot(runs, args.plot, info.world_size, args.clip)
        return 0
    finally:
        mdist.teardown()


def _plot(runs: dict, path: str, world: int, clip: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("ddp", "-"), ("sharded", "--"), (BASELINE, ":")):
        if mode in runs:
            ax.plot(runs[mode]["losses"], style, label=f"{mode} ({len(runs[mode]['skipped'])} skipped)")
    for step in runs["ddp"]["skipped"]:
        ax.axvline(step, color="grey", alpha=0.3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"fp16 with fp32 masters, {world} ranks, {f'clipping at {clip:g}' if clip else 'no clipping'}: "
                 "DDP vs sharded (FSDP2)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _run_memory_rank(args) -> int:
    info = mdist.init(backend="gloo", device="cpu")
    try:
        rows = memory_rows(args.model, args.optimizers, args.paths, args.image_size)
        if info.rank == 0:
            with open(args.out, "w") as f:
                json.dump(rows, f)
        return 0
    finally:
        mdist.teardown()


def _run_memory(args) -> int:
    rows = []
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "rows.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m",
                   "mpfp16.bench.sharding", "memory-rank", "--model", args.model, "--optimizers",
                   ",".join(args.optimizers), "--paths", ",".join(args.paths), "--image-size", str(args.image_size),
                   "--out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                print(f"memory with {n} ranks failed: {last_error_line(proc.stdout + proc.stderr)}", file=sys.stderr)
                return 1
            with open(out) as f:
                rows += json.load(f)
            print(f"{n} rank{'s' if n > 1 else ''}: done", file=sys.stderr)
    print(f"bytes per parameter held by each rank between steps, {args.model} ({rows[0]['params']:,} parameters)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _optimizers(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in ("sgd", "adam")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"optimizers are sgd and adam, got {text!r}")
    return names


def _paths(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in PATHS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"paths are {', '.join(PATHS)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpfp16.bench.sharding", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trajectory", help="DDP and sharded runs on the same data (under torchrun)")
    t.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    t.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    t.add_argument("--batch-size", type=int, default=8, help="images per rank per micro-batch (default: 8)")
    t.add_argument("--accum", type=int, default=1, help="micro-batches per step (default: 1)")
    t.add_argument("--width", type=int, default=8, help="resnet9 width (default: 8)")
    t.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0: no clipping (default: 1.0)")
    t.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="inner optimizer (default: sgd)")
    t.add_argument("--nan-steps", type=_int_list, default=[30, 70], help="steps whose batch holds a NaN on one rank "
                   "(default: 30,70)")
    t.add_argument("--json", help="write the figures and both loss curves here (default: none)")
    t.add_argument("--plot", help="write the loss curves as an image here (default: none)")
    m = sub.add_parser("memory", help="bytes per parameter per rank for N ranks, DDP and sharded")
    m.add_argument("--ranks", type=_int_list, default=[1, 2, 4], help="world sizes (default: 1,2,4)")
    m.add_argument("--model", default="resnet50", help="torchvision model name, or resnet9[-wN] (default: resnet50)")
    m.add_argument("--optimizers", type=_optimizers, default=["sgd", "adam"], help="(default: sgd,adam)")
    m.add_argument("--paths", type=_paths, default=list(PATHS), help="of ddp, ddp-fused, sharded (default: all)")
    m.add_argument("--image-size", type=int, default=64, help="of the 4 random images per rank (default: 64)")
    m.add_argument("--json", help="write the rows here (default: none)")
    r = sub.add_parser("memory-rank")  # one world size, launched by "memory"
    r.add_argument("--model", required=True)
    r.add_argument("--optimizers", type=_optimizers, required=True)
    r.add_argument("--paths", type=_paths, required=True)
    r.add_argument("--image-size", type=int, required=True)
    r.add_argument("--out", required=True)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("json", "plot"):
        path = getattr(args, name, None)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            print(f"--{name} {path}: its folder does not exist", file=sys.stderr)
            return 2
    if args.command == "trajectory":
        return _run_trajectory(args)
    if args.command == "memory":
        return _run_memory(args)
    return _run_memory_rank(args)


if __name__ == "__main__":
    sys.exit(main())
