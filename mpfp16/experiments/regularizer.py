"""The regularizer claim: does stepping fp16 weights without masters raise accuracy?

Users of diux-dev/cluster's CIFAR script found that dropping the fp32 master weights
gave higher accuracy. Here every precision mode trains the same small ResNet on the
same embedded CIFAR-shaped data for several seeds: fp32; fp16 with masters; fp16
without masters, with nearest, stochastic and Kahan rounding; bf16 with masters. The
table reports the final validation accuracy as mean ± standard deviation, whatever it
shows.
"""

from __future__ import annotations

import statistics
import time

from . import common as C

NAME = "regularizer"


def run(setup: C.Setup, seeds: list[int], out_dir: str, doc: str) -> dict:
    results: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for mode in C.MODES:
        started = time.perf_counter()
        results[mode] = []
        for seed in seeds:
            model, opt = C.build(mode, setup, seed)
            results[mode].append(C.train(model, opt, setup, seed))
        seconds[mode] = (time.perf_counter() - started) / len(seeds)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(results)
    for i, mode in enumerate(names):
        ax.scatter([i] * len(results[mode]), results[mode], color=f"C{i}", zorder=3)
        ax.errorbar(i, statistics.mean(results[mode]), yerr=_std(results[mode]), color="black", capsize=6, fmt="_")
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=8)
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"final accuracy by precision mode, {len(seeds)} seeds (mean ± std)")
    ax.grid(axis="y", alpha=0.3)
    png = f"{out_dir}/exp_regularizer.png"
    C.savefig(fig, png)
    plt.close(fig)

    ref = statistics.mean(results["fp16 + masters"])
    rows = ["| mode | accuracy, mean ± std (%) | seeds | vs fp16 + masters | s per run |",
            "|---|---:|---|---:|---:|"]
    for mode, accs in results.items():
        rows.append(f"| {mode} | {statistics.mean(accs):.2f} ± {_std(accs):.2f} | "
                    f"{', '.join(f'{a:.1f}' for a in accs)} | {statistics.mean(accs) - ref:+.2f} | {seconds[mode]:.0f} |")
    best = max(results, key=lambda m: statistics.mean(results[m]))
    spread = max(_std(a) for a in results.values())
    gain = statistics.mean(results["fp16, no masters, nearest"]) - ref
    if abs(gain) <= spread:
        verdict = (f"fp16 without masters (nearest rounding) scored {gain:+.2f} points against fp16 with masters, "
                   f"within the seed-to-seed spread: this run neither supports nor refutes the claim.")
    elif gain > 0:
        verdict = (f"fp16 without masters (nearest rounding) scored {gain:+.2f} points above fp16 with masters, "
                   f"more than the seed-to-seed spread: this run supports the claim.")
    else:
        verdict = (f"fp16 without masters (nearest rounding) scored {gain:+.2f} points below fp16 with masters, "
                   f"more than the seed-to-seed spread: this run contradicts the claim.")
    md = f"""## (c) The regularizer claim: fp16 without master weights

`python -m mpfp16.experiments {NAME}` — resnet9-w{setup.width}, {setup.train_images} training and
{setup.val_images} validation images of the embedded CIFAR-shaped data, {setup.epochs} epochs,
batch {setup.batch_size}, SGD with Nesterov momentum, one-cycle lr {setup.lr}, weight decay
{setup.weight_decay}, seeds {', '.join(map(str, seeds))}; every mode sees the same data, order and flips.

{chr(10).join(rows)}

The best mean is **{best}**; the largest standard deviation across seeds is
{spread:.2f} points, so differences smaller than about that are noise. {verdict}

![accuracy by mode]({C.link(png, doc)})
"""
    C.write_section(doc, NAME, md)
    return {"results": results}


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0
