"""bf16 with ``master_weights="remainder"`` on a real run, against bf16 with fp32 masters:
how often a master lies exactly halfway between two bf16 values (a tie: the one place
where the two modes' weights may differ), and what follows (docs/REMAINDER.md).

    python -m mpfp16.bench.remainder [--model mlp|resnet9] [--optimizer sgd,adamw]
                                     [--steps 300] [--batch-size 64] [--json PATH]

For each optimizer, two bf16 runs from the same weights over the same batches of the
embedded synthetic CIFAR-shaped images: one with fp32 masters, one with remainders,
step by step side by side. After each step it counts, in the remainder run, the
elements whose remainder is -0x8000 (a tie) and, of those, the ones whose upper half
is even (where round-to-nearest-even would have kept the weight toward zero: the
weights differ); in the fp32-master run, the masters whose lower half is 0x8000. The
runs are bit-identical up to the first step with such a difference; from there they
are two runs of the same training, and the table says how far apart they end, next
to how far the training moved the weights from where they started, for scale.

SGD: momentum 0.9, weight decay 5e-4, lr 0.1; AdamW: lr 1e-3, weight decay 0.05
(round values, as users set them; ``--lr`` and ``--weight-decay`` override them: see
the docs for what SGD without weight decay and a round learning rate does to the first
steps). The unfused step: the fused one does the same arithmetic (for SGD bit for bit;
Adam's sqrt may differ in the last bit), without its compile time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn as nn

from ..convert import to_half
from ..optimizer import FP16Optimizer
from ..rounding import REMAINDER_TIE
from ..train.data import synthetic_images
from ..train.models import resnet9

OPTIMIZERS = ("sgd", "adamw")


def build_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if name == "resnet9":
        return resnet9(8, 10)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.LayerNorm(256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def inner(kind: str, params, lr: float | None = None, weight_decay: float | None = None) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1 if lr is None else lr, momentum=0.9,
                               weight_decay=5e-4 if weight_decay is None else weight_decay)
    return torch.optim.AdamW(params, lr=1e-3 if lr is None else lr,
                             weight_decay=0.05 if weight_decay is None else weight_decay)


def tie_counts(opt: FP16Optimizer) -> tuple[int, int]:
    """(ties, ties over an even upper half) among the masters now."""
    ties = even = 0
    for g in opt.store.groups:
        if g.remainder is not None:
            tie = g.remainder == REMAINDER_TIE
            ties += int(tie.sum())
            even += int((tie & (g.weights.view(torch.int16) % 2 == 1)).sum())  # rounded up from an even one
        elif g.has_master:
            bits = g.master.view(torch.int32)
            tie = (bits & 0xFFFF) == 0x8000
            ties += int(tie.sum())
            even += int((tie & ((bits >> 16) % 2 == 0)).sum())
    return ties, even


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.detach().view(torch.int16) if p.dtype == torch.bfloat16 else p.detach(),
                           q.detach().view(torch.int16) if q.dtype == torch.bfloat16 else q.detach())
               for p, q in zip(a.parameters(), b.parameters()))


def difference(a: nn.Module, b: nn.Module) -> float:
    """The 2-norm of a's weights minus b's, relative to b's."""
    pairs = [(p.detach().float(), q.detach().float()) for p, q in zip(a.parameters(), b.parameters())]
    return (sum(float(((p - q) ** 2).sum()) for p, q in pairs) / sum(float((q ** 2).sum()) for _, q in pairs)) ** 0.5


def run(model_name: str, kind: str, steps: int, batch_size: int, seed: int = 0, lr: float | None = None,
        weight_decay: float | None = None) -> dict:
    images, labels = synthetic_images(steps * batch_size, 32, 10, seed=1)
    x_all = (images.float() / 255 - 0.5) / 0.25
    models, opts = {}, {}
    start = to_half(build_model(model_name, seed), torch.bfloat16)
    for mode in ("fp32", "remainder"):
        models[mode] = to_half(build_model(model_name, seed), torch.bfloat16)
        opts[mode] = FP16Optimizer(inner(kind, models[mode].parameters(), lr, weight_decay), loss_scale=None,
                                   master_weights="remainder" if mode == "remainder" else True, fused=False)
    n16 = sum(p.numel() for p in models["remainder"].parameters() if p.dtype == torch.bfloat16)
    per_step, first_difference, losses = [], None, {}
    for step in range(steps):
        x = x_all[step * batch_size:(step + 1) * batch_size].to(torch.bfloat16)
        y = labels[step * batch_size:(step + 1) * batch_size]
        for mode, model in models.items():
            opts[mode].zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), y)
            opts[mode].backward(loss)
            opts[mode].step()
            losses[mode] = float(loss.detach())
        ties, even = tie_counts(opts["remainder"])
        ties_fp32, even_fp32 = tie_counts(opts["fp32"])
        if first_difference is None and not same_weights(models["fp32"], models["remainder"]):
            first_difference = step + 1
        per_step.append({"step": step + 1, "ties": ties, "ties_over_even": even, "fp32_ties": ties_fp32,
                         "fp32_ties_over_even": even_fp32})
    differing = sum(int((p.detach() != q.detach()).sum())
                    for p, q in zip(models["remainder"].parameters(), models["fp32"].parameters()))
    total = sum(s["ties"] for s in per_step)
    return {"model": model_name, "optimizer": kind, "steps": steps, "bf16_params": n16, "per_step": per_step,
            "ties": total, "ties_over_even": sum(s["ties_over_even"] for s in per_step),
            "ties_per_million_element_steps": 1e6 * total / (n16 * steps),
            "steps_with_a_tie": sum(1 for s in per_step if s["ties"]),
            "first_10_steps_ties": sum(s["ties"] for s in per_step[:10]),
            "first_weight_difference_step": first_difference,
            "final_loss": dict(losses), "weights_differing_at_end": differing,
            "relative_difference_at_end": difference(models["remainder"], models["fp32"]),
            "moved_by_training": difference(models["fp32"], start)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "resnet9"], default="mlp",
                        help="mlp: 3072-256-256-10 with a LayerNorm (855k parameters); resnet9: width 8 (default: mlp)")
    parser.add_argument("--optimizer", default="sgd,adamw", help="sgd, adamw or both (default: sgd,adamw)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step (default: 64)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.1 SGD, 1e-3 AdamW)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="weight decay (default: 5e-4 SGD, 0.05 AdamW)")
    parser.add_argument("--seed", type=int, default=0, help="the models' initial weights (default: 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.optimizer.split(",") if k.strip()]
    if not kinds or any(k not in OPTIMIZERS for k in kinds):
        parser.error(f"--optimizer takes sgd, adamw or both, got {args.optimizer!r}")
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be >= 1")
    results = []
    for kind in kinds:
        r = run(args.model, kind, args.steps, args.batch_size, args.seed, args.lr, args.weight_decay)
        results.append(r)
        print(f"# {r['model']}, {kind}{'' if args.lr is None else f' lr {args.lr:g}'}"
              f"{'' if args.weight_decay is None else f' weight decay {args.weight_decay:g}'}, bf16, {r['steps']} steps, "
              f"{r['bf16_params']:,} bf16 parameters")
        print(f"ties (a master exactly halfway between two bf16 values), summed over the steps: {r['ties']:,} "
              f"({r['ties_per_million_element_steps']:.1f} per million element-steps; at 2**-16 it would be 15.3), "
              f"in {r['steps_with_a_tie']} of {r['steps']} steps, {r['first_10_steps_ties']:,} in the first 10")
        print(f"  of which over an even value (the weight differs from round-to-nearest-even): {r['ties_over_even']:,}")
        first = r["first_weight_difference_step"]
        print(f"  the two runs' weights are {'bit-identical throughout' if first is None else f'first apart after step {first}'}"
              f"; at the end {r['weights_differing_at_end']:,} weights differ, the difference {r['relative_difference_at_end']:.2e} "
              f"of the weights' 2-norm (training moved them by {r['moved_by_training']:.2e} of it); final loss "
              f"{r['final_loss']['fp32']:.4f} (fp32 masters), {r['final_loss']['remainder']:.4f} (remainders)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
