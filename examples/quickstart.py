"""The mpfp16 API in one small run: an MLP learns a synthetic 4-class task in fp16
with fp32 master weights and dynamic loss scaling, next to the same run in fp32.

    python examples/quickstart.py [--steps 200] [--precision fp16|bf16]
"""

import argparse

import torch
import torch.nn as nn

import mpfp16


def make_data(n: int, seed: int = 0):
    """Points in 8-d whose class is the quadrant of two fixed projections: learnable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 2, generator=torch.Generator().manual_seed(1234))
    z = x @ w
    y = (z[:, 0] > 0).long() * 2 + (z[:, 1] > 0).long()
    return x, y


def train(precision: str, steps: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
    if precision != "fp32":
        model = mpfp16.to_half(model, torch.float16 if precision == "fp16" else torch.bfloat16)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               loss_scale="dynamic", max_grad_norm=5.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    x, y = make_data(4096)
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x), (128,))
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        opt.backward(loss)
        stepped = opt.step()
        sched.step()
        if step % max(1, steps // 5) == 0:
            norm = f"{opt.last_grad_norm:.3f}" if stepped else "- (skipped)"  # no norm on a skipped step
            print(f"  [{precision}] step {step:4d}  loss {loss.item():.4f}  scale {opt.loss_scale:g}  "
                  f"skipped {opt.skipped_steps}  grad_norm {norm}")
    xv, yv = make_data(2048, seed=1)
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    mem = opt.memory_bytes_per_param()
    print(f"  [{precision}] validation accuracy {acc:.3f}; optimizer-side memory {mem['total']:.1f} B/param")
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--precision", choices=["fp16", "bf16"], default="fp16",
                        help="16-bit format (default: fp16)")
    args = parser.parse_args()
    acc16 = train(args.precision, args.steps)
    acc32 = train("fp32", args.steps)
    print(f"accuracy: {args.precision} {acc16:.3f}, fp32 {acc32:.3f} (chance 0.25)")


if __name__ == "__main__":
    main()
