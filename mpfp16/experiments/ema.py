"""How much of a model EMA's movement a 16-bit average loses (``--model-ema``): the
EMA of the 16-bit weights, as torchvision's ``ExponentialMovingAverage`` keeps it for a
16-bit model (a copy of the model, in its dtype), against the fp32 EMA of the fp32
masters that the trainer keeps (mpfp16/train/ema.py), both against an fp64 reference.

The sequence averaged is a real one: the fp32 masters of a bf16-with-masters training
run of resnet9 on the embedded CIFAR-shaped data, at every optimizer step, its 16-bit
(conv and linear) weights only (the norm layers are fp32 in both schemes). The 16-bit
weights are those masters rounded to nearest, as FP16Optimizer copies them to the
model: the run's own bf16 weights, and the fp16 weights an fp16 model holding the same
masters would have. Every average is updated at every step with the decays listed,
torchvision's ``decay * avg + (1 - decay) * weight`` computed in the average's dtype
(:func:`mpfp16.train.ema.average_`); the reference is the same average of the masters
in fp64 (exact inputs, the decay as given).

Reported per average and decay, at the end of the run, with ``Δ`` the movement from
the start (the first update copies the weights):

- movement lost: ``1 - <Δavg, Δref> / <Δref, Δref>``, the share of the reference's
  movement that the average did not make (100%: it never moved);
- error: ``|avg - ref| / |Δref|``, how far it ended from the reference, in units of
  the reference's movement;
- updates lost: the share of element updates whose exact change (in fp64, from the
  stored average and its input) was not zero, but that left the stored average as it
  was (Micikevicius et al. 2018, section 3.1, applied to the average).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..train.ema import average_, ema_decay
from . import common as C

NAME = "ema"
PNG = "exp_ema.png"

# The average, its dtype, and the weights it takes (the fp32 masters, or the masters
# rounded to a 16-bit dtype).
AVERAGES = {
    "fp32 EMA of the fp32 masters (--model-ema)": (torch.float32, torch.float32),
    "fp32 EMA of the fp16 weights": (torch.float32, torch.float16),
    "fp16 EMA of the fp16 weights (torchvision, fp16 model)": (torch.float16, torch.float16),
    "bf16 EMA of the bf16 weights (torchvision, bf16 model)": (torch.bfloat16, torch.bfloat16),
}
OURS = "fp32 EMA of the fp32 masters (--model-ema)"

# torchvision's ResNet-50 recipe (8 GPUs x 128, --model-ema-steps 32, 600 epochs):
# the decay of one of its updates, --model-ema-decay 0.99998 adjusted.
RECIPE = {"world_size": 8, "batch_size": 128, "model_ema_steps": 32, "epochs": 600}


@dataclass
class EMASetup(C.Setup):
    """The training run whose masters are averaged (:class:`mpfp16.experiments.common.Setup`
    with this experiment's sizes); its defaults run in about a minute on a 2-core CPU."""

    val_images: int = 200
    epochs: int = 5
    batch_size: int = 32


def quick() -> EMASetup:
    """A tiny run, for the tests."""
    return EMASetup(width=4, train_images=128, val_images=64, epochs=2, batch_size=32)


RECIPE_LABEL = "torchvision's ResNet-50 recipe: 0.99998 adjusted (8 x 128 x 32 / 600)"
UNADJUSTED = "--model-ema-decay 0.99998, unadjusted"
PLOTTED = (RECIPE_LABEL, UNADJUSTED)


def decays(setup: EMASetup) -> list[tuple[str, float]]:
    """(what it is, decay per update), the largest alpha first."""
    recipe = ema_decay(RECIPE["world_size"], RECIPE["batch_size"], 1, RECIPE["model_ema_steps"], RECIPE["epochs"],
                       0.99998)
    this_run = ema_decay(1, setup.batch_size, 1, 1, setup.epochs, 0.99998)
    found = [("0.99", 0.99), (RECIPE_LABEL, recipe),
             (f"this run: 0.99998 adjusted (1 x {setup.batch_size} x 1 / {setup.epochs})", this_run),
             ("0.9999", 0.9999), (UNADJUSTED, 0.99998)]
    return sorted(found, key=lambda kv: kv[1])


class _Averages:
    """Every average of one decay, and the fp64 reference, updated step by step."""

    def __init__(self, decay: float, first: torch.Tensor, history: bool = False) -> None:
        self.decay, self.history = decay, history
        self.ref = first.double()
        self.avgs = {name: first.to(weights).to(dtype).clone() for name, (dtype, weights) in AVERAGES.items()}
        self.start = {name: avg.double() for name, avg in self.avgs.items()}
        self.ref_start = self.ref.clone()
        self.changed = {name: 0 for name in AVERAGES}  # element updates that were not zero, exactly
        self.lost = {name: 0 for name in AVERAGES}  # of those, the ones the stored average did not take
        self.kept: dict[str, list[float]] = {name: [] for name in AVERAGES}  # movement kept, per step

    def update(self, masters64: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """One update from the masters (in fp64) and each average's input (``values``)."""
        d = self.decay
        self.ref = d * self.ref + (1 - d) * masters64
        if self.history:
            moved = self.ref - self.ref_start
            norm = float(moved.dot(moved))
        for name, avg in self.avgs.items():
            value = values[name]
            asked = value != avg  # the exact change, (1 - d) * (value - avg), is not zero
            before = avg.clone()
            average_([avg], [value], d)
            self.changed[name] += int(asked.sum())
            self.lost[name] += int((asked & (avg == before)).sum())
            if self.history:
                kept = float((avg.double() - self.start[name]).dot(moved)) / norm if norm > 0 else 1.0
                self.kept[name].append(kept)

    def summary(self) -> dict[str, dict]:
        moved = self.ref - self.ref_start
        norm = float(moved.norm())
        out = {}
        for name in AVERAGES:
            avg = self.avgs[name].double()
            delta = avg - self.start[name]
            out[name] = {"movement_lost": 1 - float(delta.dot(moved)) / norm**2 if norm > 0 else 0.0,
                         "error": float((avg - self.ref).norm()) / norm if norm > 0 else 0.0,
                         "updates_lost": self.lost[name] / max(1, self.changed[name])}
        return out


def measure(setup: EMASetup, seed: int) -> dict:
    """Train, averaging the masters at every step with every decay and average."""
    started = time.perf_counter()
    model, opt = C.build("bf16 + masters", setup, seed)
    tracked = [m for p, m in zip(opt.model_params(), opt.master_params()) if p.dtype == torch.bfloat16]

    def flat() -> torch.Tensor:
        return torch.cat([m.detach().reshape(-1) for m in tracked])

    runs: list[tuple[str, _Averages]] = []
    steps: list[int] = []

    def on_step(step, stepped):
        if not stepped:
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small elementwise ops: a second thread only waits (on a busy machine, long)
        try:
            masters = flat()
            if not runs:  # the first update copies (AveragedModel's n_averaged == 0)
                runs.extend((label, _Averages(decay, masters, history=label in PLOTTED))
                            for label, decay in decays(setup))
            else:
                masters64 = masters.double()
                values = {name: masters.to(weights).to(dtype) for name, (dtype, weights) in AVERAGES.items()}
                for _, averages in runs:
                    averages.update(masters64, values)
                steps.append(step)
        finally:
            torch.set_num_threads(threads)

    accuracy = C.train(model, opt, setup, seed, on_step=on_step)
    return {"accuracy": accuracy, "elements": sum(m.numel() for m in tracked), "steps": steps,
            "updates": len(steps), "seconds": time.perf_counter() - started,
            "results": [(label, averages.decay, averages.summary(), averages.kept) for label, averages in runs]}


def run(setup: EMASetup | None, seed: int, out_dir: str, doc: str) -> dict:
    setup = setup or EMASetup()
    result = measure(setup, seed)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in result["results"] if r[0] in PLOTTED]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4.2), squeeze=False)
    for ax, (label, decay, _, kept) in zip(axes[0], shown):
        for name in AVERAGES:
            ax.plot(result["steps"], [100 * k for k in kept[name]], label=name, lw=1.3)
        short = "ResNet-50 recipe: 0.99998 adjusted" if label == RECIPE_LABEL else "0.99998, unadjusted"
        ax.set_title(f"decay {decay:.8g} ({short})", fontsize=9)
        ax.set_xlabel("optimizer step (one update each)")
        ax.set_ylabel("movement of the fp64 EMA made (%)")
        ax.axhline(100, color="grey", lw=0.5)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("EMA of the 16-bit weights against the fp32 EMA of the fp32 masters", fontsize=10)
    png = f"{out_dir}/{PNG}"
    C.savefig(fig, png)
    plt.close(fig)

    rows = ["| decay per update | what it is | " + " | ".join(AVERAGES) + " |",
            "|---:|---|" + "---:|" * len(AVERAGES)]
    for label, decay, summary, _ in result["results"]:
        cells = [f"{100 * summary[n]['movement_lost']:.1f}% / {summary[n]['error']:.3f} / "
                 f"{100 * summary[n]['updates_lost']:.1f}%" for n in AVERAGES]
        rows.append(f"| {decay:.8g} | {label} | " + " | ".join(cells) + " |")
    by_label = {label: summary for label, _, summary, _ in result["results"]}
    recipe, unadjusted = by_label[RECIPE_LABEL], by_label[UNADJUSTED]
    md = f"""### Measured: the EMA of the 16-bit weights against the fp32 EMA of the fp32 masters

`python -m mpfp16.experiments {NAME}` — the fp32 masters of resnet9-w{setup.width} trained in bf16 with
fp32 masters on the embedded CIFAR-shaped data ({setup.train_images} images, {setup.epochs} epochs, batch
{setup.batch_size}, one-cycle lr {setup.lr}, seed {seed}; validation accuracy {result['accuracy']:.1f}%), its
{result['elements']:,} conv and linear weights averaged at each of {result['updates']} optimizer steps after
the first (which copies) with torchvision's `decay * avg + (1 - decay) * weight`, in the
average's dtype; the reference is the same average of the masters in fp64. The 16-bit weights
are the masters rounded to nearest, as FP16Optimizer copies them to the model. {result['seconds']:.0f} s.

Each cell: **movement lost** (the share of the fp64 average's movement from its start that
the average did not make; 100%: it never moved) / **error** (its distance to the fp64 average
at the end, in units of that movement) / **updates lost** (element updates whose exact change
was not zero but left the stored average as it was).

{chr(10).join(rows)}

{_findings(recipe, unadjusted)}

The run is short: the weights stay near their start, and an update's share lost is the
share of it a 16-bit average cannot hold, which is what carries over to a long run, not the
accuracy. Every average here is updated at every step; torchvision's updates every 32 steps,
each one then sees 32 steps of movement, and a 16-bit average loses less of it at the same
decay than here.

![EMA movement kept]({C.link(png, doc)})
"""
    C.write_section(doc, NAME, md)
    return result


def _findings(recipe: dict, unadjusted: dict) -> str:
    """The paragraph that reads the table: the recipe's decay and 0.99998 unadjusted."""
    fp16 = "fp16 EMA of the fp16 weights (torchvision, fp16 model)"
    bf16 = "bf16 EMA of the bf16 weights (torchvision, bf16 model)"
    widened = "fp32 EMA of the fp16 weights"

    def pct(summary, name, key):
        return f"{100 * summary[name][key]:.1f}%"

    return (f"At the decay of torchvision's ResNet-50 recipe the fp16 average of the fp16 weights dropped "
            f"{pct(recipe, fp16, 'updates_lost')} of its element updates and ended {recipe[fp16]['error']:.2f} of the "
            f"reference's movement away from it, the bf16 one {pct(recipe, bf16, 'updates_lost')} and "
            f"{recipe[bf16]['error']:.2f}; at 0.99998 unadjusted the fp16 average made "
            f"{100 * (1 - unadjusted[fp16]['movement_lost']):.1f}% of the movement and the bf16 one "
            f"{100 * (1 - unadjusted[bf16]['movement_lost']):.1f}% (their updates lost: "
            f"{pct(unadjusted, fp16, 'updates_lost')}, {pct(unadjusted, bf16, 'updates_lost')}). The fp32 average of "
            f"the fp32 masters lost {pct(unadjusted, OURS, 'updates_lost')} of its updates at 0.99998 (error "
            f"{unadjusted[OURS]['error']:.4f}) and {pct(recipe, OURS, 'updates_lost')} at the recipe's decay. An fp32 "
            f"average of the 16-bit weights lost {pct(unadjusted, widened, 'updates_lost')} of its updates at 0.99998, "
            "but keeps the rounding of its inputs (a weight that moves by less than an ulp rounds to the same 16-bit "
            f"value step after step): its error is {unadjusted[widened]['error']:.3f} at 0.99998 and "
            f"{recipe[widened]['error']:.4f} at the recipe's decay. A movement lost below zero is an average that went "
            "further along the reference's path than the reference, by the rounding of its updates; the error says "
            "how far it ended from it.")
