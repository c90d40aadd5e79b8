"""One command to check mpfp16 on a GPU: CUDA tests, ResNet-50 throughput, the step
benchmark and a CIFAR epoch, into one JSON file and one markdown table.

    python -m mpfp16.bench.gpu [--out gpu_check] [--batch-size 256]   # about 5 minutes on one GPU
    python -m mpfp16.bench.gpu --dry-run                              # tiny sizes, on CPU too (CI)

1. ``pytest -m cuda``: the tests that need a GPU (skipped on CPU).
2. ResNet-50 training throughput (img/s, synthetic data, channels_last) for: fp32;
   torch.amp autocast(fp16) with GradScaler; mpfp16 fp16 with fp32 masters; mpfp16 fp16
   without masters; mpfp16 bf16 with masters. Each: warm-up steps, then timed steps
   between CUDA events.
3. ``python -m mpfp16.bench.step`` on the device (SGD and AdamW).
4. One epoch of ``train_cifar.py`` on its embedded data, wall time.

Targets on a GPU: mpfp16 fp16 with masters at least torch.amp's throughput and at
least 2.5x fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn

from ..convert import to_half
from ..optimizer import FP16Optimizer
from .timing import Timer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("fp32", "torch.amp fp16", "mpfp16 fp16 + masters", "mpfp16 fp16, no masters", "mpfp16 bf16 + masters")


def throughput(mode: str, arch: str, batch: int, image: int, steps: int, warmup: int, device) -> dict:
    """Training images per second of one configuration."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(arch, weights=None).to(device).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, image, image, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    sgd = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    if mode in ("fp32", "torch.amp fp16"):
        opt = torch.optim.SGD(model.parameters(), **sgd, fused=device.type == "cuda" or None)
        scaler = torch.amp.GradScaler(device.type, enabled=mode != "fp32")

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=mode != "fp32"):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    else:
        to_half(model, torch.bfloat16 if "bf16" in mode else torch.float16)
        opt = FP16Optimizer(torch.optim.SGD(model.parameters(), **sgd), master_weights="no masters" not in mode)

        def step():
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()

    for _ in range(warmup):
        step()
    with Timer(device) as t:
        for _ in range(steps):
            step()
    skipped = getattr(opt, "skipped_steps", None)
    return {"mode": mode, "img_per_s": batch * steps / t.seconds, "step_ms": 1e3 * t.seconds / steps,
            "skipped_steps": skipped}


def run_command(cmd: list[str], timeout: float) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return {"command": " ".join(cmd), "returncode": proc.returncode, "seconds": time.perf_counter() - started,
            "tail": tail}


def markdown(report: dict) -> str:
    lines = [f"# GPU check — {report['device']}, torch {report['torch']}, {report['date']}", "",
             f"Command: `{report['command']}`", "",
             f"- CUDA tests (`pytest -m cuda`): exit status {report['cuda_tests']['returncode']}; "
             f"{report['cuda_tests']['tail'][-1] if report['cuda_tests']['tail'] else ''}",
             f"- one epoch of `train_cifar.py` on its embedded data: {report['cifar_epoch']['seconds']:.1f} s "
             f"(exit status {report['cifar_epoch']['returncode']})", "",
             f"{report['arch']} training throughput, batch {report['batch_size']} at {report['image_size']}px, "
             "channels_last, synthetic data:", "",
             "| mode | img/s | ms / step | vs fp32 | vs torch.amp |", "|---|---:|---:|---:|---:|"]
    rates = {r["mode"]: r["img_per_s"] for r in report["throughput"]}
    for r in report["throughput"]:
        lines.append(f"| {r['mode']} | {r['img_per_s']:.0f} | {r['step_ms']:.1f} | "
                     f"{r['img_per_s'] / rates['fp32']:.2f} | {r['img_per_s'] / rates['torch.amp fp16']:.2f} |")
    target = rates["mpfp16 fp16 + masters"]
    lines += ["", f"Targets: fp16 with masters >= torch.amp: {'met' if target >= rates['torch.amp fp16'] else 'NOT met'} "
                  f"({target / rates['torch.amp fp16']:.2f}x); >= 2.5x fp32: "
                  f"{'met' if target >= 2.5 * rates['fp32'] else 'NOT met'} ({target / rates['fp32']:.2f}x).", ""]
    for name, result in report["step_bench"].items():
        lines += [f"Step benchmark, {name} (exit status {result['returncode']}):", "", "```", *result["tail"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md "
                                                            "(default: gpu_check)")
    parser.add_argument("--batch-size", type=int, default=256, help="ResNet-50 batch (default: 256)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode (default: 20)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes (resnet18 at 32px, batch 4, a 256-image CIFAR epoch): checks the "
                             "command itself, on CPU too (default: off)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        print("error: no CUDA GPU is available; use --dry-run to check the command on CPU", file=sys.stderr)
        return 2
    arch, batch, image, steps, warmup = (("resnet18", 4, 32, 2, 1) if args.dry_run
                                         else ("resnet50", args.batch_size, 224, args.steps, 5))
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "python -m mpfp16.bench.gpu" + (" --dry-run" if args.dry_run else ""),
              "arch": arch, "batch_size": batch, "image_size": image}
    print("1/4 CUDA tests ...", flush=True)
    # The CUDA tests are all in tests/test_cuda.py: collecting the whole suite again took a minute.
    # -n 0: in one process (the suite's default is two pytest-xdist workers, pyproject.toml).
    report["cuda_tests"] = run_command([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-n", "0", "-p",
                                        "no:cacheprovider", "tests/test_cuda.py"], timeout=240)
    print(f"2/4 {arch} throughput ...", flush=True)
    report["throughput"] = [throughput(m, arch, batch, image, steps, warmup, device) for m in MODES]
    print("3/4 step benchmark ...", flush=True)
    bench = ["--model", "squeezenet1_1", "--rounds", "1", "--warmup", "1"] if args.dry_run else ["--rounds", "10"]
    report["step_bench"] = {opt: run_command([sys.executable, "-m", "mpfp16.bench.step", "--optimizer", opt, *bench],
                                             timeout=240) for opt in ("sgd", "adamw")}
    print("4/4 one CIFAR epoch ...", flush=True)
    cifar = [sys.executable, "train_cifar.py", "--epochs", "1", "--no-progress", "--checkpoint-dir",
             os.path.join(os.path.abspath(args.out), "cifar_checkpoints")]
    if args.dry_run:
        cifar += ["--synthetic-size", "256,64", "-a", "resnet9-w4", "-b", "32"]
    report["cifar_epoch"] = run_command(cifar, timeout=300)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text)
    failed = [k for k in ("cuda_tests", "cifar_epoch") if report[k]["returncode"] != 0]
    failed += [f"step_bench {k}" for k, v in report["step_bench"].items() if v["returncode"] != 0]
    if failed:
        print(f"error: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
