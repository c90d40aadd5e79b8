"""Micikevicius et al. 2018, §3.1: how many weight updates fp16 alone would lose.

An fp16 model trains with fp32 masters. At every step, for each 16-bit weight tensor,
it counts the elements whose update (new master - old master, in fp32) is not zero
but would vanish if added to the fp16 weight directly: fp16(w + update) == w. That
happens when the weight is about 2048 times larger than its update.
"""

from __future__ import annotations

import torch

from . import common as C

NAME = "lost-updates"


def lost_fraction(old: torch.Tensor, update: torch.Tensor) -> float:
    """The share of the non-zero fp32 ``update``s of fp32 weights ``old`` that would
    vanish added to the fp16 weight directly: fp16(old + update) == fp16(old)."""
    moved = update != 0
    lost = ((old + update).half() == old.half()) & moved
    return lost.sum().item() / max(1, moved.sum().item())


def run(setup: C.Setup, seed: int, out_dir: str, doc: str) -> dict:
    model, opt = C.build("fp16 + masters", setup, seed)
    names = {id(p): n for n, p in model.named_parameters()}
    tracked = [(names[id(p)], p, m) for p, m in zip(opt.model_params(), opt.master_params())
               if p.dtype == torch.float16 and p.dim() > 1]
    before: list[torch.Tensor] = []
    history: dict[str, list[float]] = {name: [] for name, _, _ in tracked}
    steps: list[int] = []

    def snapshot(step):
        before[:] = [m.detach().clone() for _, _, m in tracked]

    def measure(step, stepped):
        if not stepped:
            return
        steps.append(step)
        for (name, p, m), old in zip(tracked, before):
            history[name].append(lost_fraction(old, m.detach() - old))

    acc = C.train(model, opt, setup, seed, on_step=measure, on_before_step=snapshot)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in history.items():
        ax.plot(steps, [100 * v for v in values], label=name, lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("updates lost without masters (%)")
    ax.set_title("fp16 weight updates that would vanish without fp32 masters, per layer")
    ax.legend(fontsize=6, ncol=2)
    png = f"{out_dir}/exp_lost_updates.png"
    C.savefig(fig, png)
    plt.close(fig)

    marks = sorted({0, len(steps) // 2, len(steps) - 1})
    header = "| layer | " + " | ".join(f"step {steps[i]}" for i in marks) + " | mean |"
    rows = [header, "|---|" + "---:|" * (len(marks) + 1)]
    for name, values in history.items():
        rows.append(f"| `{name}` | " + " | ".join(f"{100 * values[i]:.1f}%" for i in marks)
                    + f" | {100 * sum(values) / len(values):.1f}% |")
    overall = sum(sum(v) for v in history.values()) / sum(len(v) for v in history.values())
    md = f"""## (a) Weight updates lost without master weights (Micikevicius et al. 2018, §3.1)

`python -m mpfp16.experiments {NAME}` — resnet9-w{setup.width} in fp16 with fp32 masters on the
embedded CIFAR-shaped data ({setup.train_images} images, {setup.epochs} epochs, batch {setup.batch_size},
one-cycle lr {setup.lr}, seed {seed}); final validation accuracy {acc:.1f}%.

For each fp16 weight tensor, the share of non-zero fp32 updates that would vanish if
added to the fp16 weight directly (`fp16(w + u) == w`), at the first, middle and
last step, and averaged over all {len(steps)} steps. Over all layers and steps:
**{100 * overall:.1f}%** of updates would be lost.

{chr(10).join(rows)}

![lost updates per layer]({C.link(png, doc)})
"""
    C.write_section(doc, NAME, md)
    return {"accuracy": acc, "overall_lost": overall, "history": history, "steps": steps}
