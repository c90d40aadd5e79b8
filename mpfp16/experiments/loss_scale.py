"""A trace of the dynamic loss scale over a run.

fp16 training with a DynamicLossScaler that starts at its ceiling (2^24) and grows
every 25 clean steps: the trace shows it backing off on overflows to a workable
scale, then probing upward and backing off again.
"""

from __future__ import annotations

from . import common as C
from ..scaler import DynamicLossScaler

NAME = "loss-scale"


def run(setup: C.Setup, seed: int, out_dir: str, doc: str, growth_interval: int = 25) -> dict:
    scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=growth_interval)
    model, opt = C.build("fp16 + masters", setup, seed, loss_scale=scaler)
    scales, skipped_at = [], []

    def record(step, stepped):
        scales.append(opt.loss_scale)
        if not stepped:
            skipped_at.append(step)

    acc = C.train(model, opt, setup, seed, on_step=record)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.step(range(1, len(scales) + 1), scales, where="post", label="loss scale after the step")
    ax.scatter(skipped_at, [scales[s - 1] for s in skipped_at], color="red", marker="x", zorder=3,
               label="skipped step (inf/NaN)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"dynamic loss scaling: init 2^24, x0.5 on overflow, x2 after {growth_interval} clean steps")
    ax.legend(fontsize=8)
    png = f"{out_dir}/exp_loss_scale.png"
    C.savefig(fig, png)
    plt.close(fig)

    import math

    log2 = lambda v: f"2^{int(math.log2(v))}" if v > 0 and math.log2(v).is_integer() else f"{v:g}"  # noqa: E731
    settled = scales[len(scales) // 2:]
    md = f"""## (d) The loss scale over a run

`python -m mpfp16.experiments {NAME}` — resnet9-w{setup.width} in fp16 with masters, {len(scales)} steps
({setup.epochs} epochs of {setup.train_images} embedded images, seed {seed}), DynamicLossScaler
starting at 2^24 with growth every {growth_interval} clean steps; final validation accuracy {acc:.1f}%.

| steps | skipped | first clean step | scale after the first clean step | min / max scale, second half | final scale |
|---:|---:|---:|---|---|---|
| {len(scales)} | {len(skipped_at)} | {next((i + 1 for i in range(len(scales)) if i + 1 not in skipped_at), 0)} | {log2(scales[next((i for i in range(len(scales)) if i + 1 not in skipped_at), 0)])} | {log2(min(settled))} / {log2(max(settled))} | {log2(scales[-1])} |

Skipped steps: {', '.join(map(str, skipped_at)) or 'none'}.

![loss scale trace]({C.link(png, doc)})
"""
    C.write_section(doc, NAME, md)
    return {"scales": scales, "skipped": skipped_at, "accuracy": acc}
