"""Micikevicius et al. 2018, §3.2: gradient exponents, and what fp16 keeps of them.

An fp32 model (the exact gradients) trains for part of the run; at the start and at
the end it records the log2 magnitudes of the weight gradients and of the activation
gradients (grad_output of every convolution). For each loss scale S it reports the
share of non-zero gradients that fp16 would flush to zero (|g| S < 2^-25, below half
the smallest subnormal) or make subnormal (< 2^-14), and that would overflow
(|g| S > 65504).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import common as C

NAME = "underflow"
SCALES = (1.0, 2.0**8, 2.0**16)
FP16_TINY, FP16_MIN_NORMAL, FP16_MAX = 2.0**-25, 2.0**-14, 65504.0


def collect(model, setup) -> dict[str, torch.Tensor]:
    """log2 |g| of the non-zero weight and activation gradients of one batch."""
    (xtr, ytr), _ = C.data(setup)
    acts: list[torch.Tensor] = []
    hooks = [m.register_full_backward_hook(lambda mod, gi, go: acts.append(go[0].detach().flatten()))
             for m in model.modules() if isinstance(m, nn.Conv2d)]
    model.zero_grad()
    x = C.normalize(xtr[: setup.batch_size]).requires_grad_()  # so the first conv's hook fires too
    nn.functional.cross_entropy(model(x), ytr[: setup.batch_size]).backward()
    for h in hooks:
        h.remove()
    weights = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    out = {}
    for kind, g in (("weight gradients", weights), ("activation gradients", torch.cat(acts))):
        g = g.abs()
        out[kind] = g[g > 0].log2()
    return out


def fractions(log2g: torch.Tensor, scale: float) -> tuple[float, float, float]:
    s = torch.log2(torch.tensor(scale))
    e = log2g + s
    n = max(1, e.numel())
    return ((e < torch.log2(torch.tensor(FP16_TINY))).sum().item() / n,
            (e < torch.log2(torch.tensor(FP16_MIN_NORMAL))).sum().item() / n,
            (e > torch.log2(torch.tensor(FP16_MAX))).sum().item() / n)


def run(setup: C.Setup, seed: int, out_dir: str, doc: str) -> dict:
    model, opt = C.build("fp32", setup, seed)
    samples = {"start": collect(model, setup)}
    C.train(model, opt, setup, seed)
    samples["end"] = collect(model, setup)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, kind in zip(axes, ("weight gradients", "activation gradients")):
        for when, style in (("start", "C0"), ("end", "C1")):
            values = samples[when][kind].clamp(-60, 20)
            ax.hist(values.numpy(), bins=80, range=(-60, 20), histtype="step", color=style, density=True,
                    label=f"{when} of training")
        ax.axvspan(-60, -25, color="red", alpha=0.08, label="flushed to 0 in fp16 (S=1)")
        ax.axvspan(-25, -14, color="orange", alpha=0.08, label="subnormal in fp16")
        ax.axvline(-25 - 16, color="gray", ls=":", label="flush limit with S=2^16")
        ax.set_title(kind)
        ax.set_xlabel("log2 |gradient|")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("density")
    png = f"{out_dir}/exp_underflow.png"
    C.savefig(fig, png)
    plt.close(fig)

    rows = ["| gradients | when | loss scale | flushed to zero | subnormal | overflow |", "|---|---|---:|---:|---:|---:|"]
    table = {}
    for kind in ("weight gradients", "activation gradients"):
        for when in ("start", "end"):
            for scale in SCALES:
                zero, sub, over = fractions(samples[when][kind], scale)
                table[(kind, when, scale)] = (zero, sub, over)
                rows.append(f"| {kind} | {when} | 2^{int(torch.log2(torch.tensor(scale)))} | {100 * zero:.2f}% | "
                            f"{100 * sub:.2f}% | {100 * over:.4f}% |")
    md = f"""## (b) Gradient exponents and fp16 underflow (Micikevicius et al. 2018, §3.2)

`python -m mpfp16.experiments {NAME}` — the exact (fp32) gradients of resnet9-w{setup.width} on one batch
of {setup.batch_size} embedded CIFAR-shaped images, at initialization and after
{setup.epochs} epochs of fp32 training (seed {seed}). Shares of the non-zero gradients
that fp16 would flush to zero (|g|·S < 2^-25), leave subnormal (< 2^-14, reduced
precision) or overflow (> 65504), for loss scales S = 1, 2^8 and 2^16.

{chr(10).join(rows)}

![gradient exponents]({C.link(png, doc)})
"""
    C.write_section(doc, NAME, md)
    return {"table": table}
