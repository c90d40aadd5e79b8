"""Micikevicius et al. 2018, §3.1: how many weight updates fp16 alone would lose, and
how many PyTorch Lightning's ``precision="16-true"`` does lose.

Run 1, fp16 with fp32 masters (this package): at every step, for each 16-bit weight
tensor, it counts the elements whose update (new master - old master, in fp32) is not
zero but would vanish if added to the fp16 weight directly: fp16(w + update) == w.
That happens when the weight is about 2048 times larger than its update.

Run 2, the same model, data, order, flips, seed and SGD settings trained the way
Lightning's ``"16-true"`` trains (through ``lightning.Trainer(precision="16-true")``
when Lightning is installed): the whole module in fp16, norm layers included, no
master copy, no loss scale, ``torch.optim.SGD`` stepping the fp16 parameters (its
momentum in fp16 too). At every step, for each parameter tensor, it counts:

- lost updates: the elements that the same SGD step, computed in fp32 from the same
  fp16 weight, gradient and momentum buffer (upcast exactly), would move, but whose
  fp16 weight the real step left unchanged (:func:`sgd_step_fp32`,
  :func:`lost_in_fp16_step`);
- flushed gradients: the weight-gradient elements that are exactly zero in fp16 but
  non-zero in an fp32 forward and backward of the same batch from the same weights
  (an fp32 copy of the model, refreshed every step) (:func:`flushed_fraction`).
"""

from __future__ import annotations

import copy
import logging
import time
import warnings

import torch
import torch.nn as nn

from ..train.models import resnet9
from . import common as C

NAME = "lost-updates"
SIXTEEN_TRUE_PNG = "exp_lost_updates_16true.png"


def lost_fraction(old: torch.Tensor, update: torch.Tensor) -> float:
    """The share of the non-zero fp32 ``update``s of fp32 weights ``old`` that would
    vanish added to the fp16 weight directly: fp16(old + update) == fp16(old)."""
    moved = update != 0
    lost = ((old + update).half() == old.half()) & moved
    return lost.sum().item() / max(1, moved.sum().item())


def sgd_step_fp32(weight: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, lr: float,
                  momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> torch.Tensor:
    """The weight one ``torch.optim.SGD`` step (dampening 0) gives, computed in fp32 from
    ``weight``, ``grad`` and ``momentum_buffer`` (the optimizer's state before the step,
    ``None`` on its first) upcast exactly: torch's own single-tensor rule, op for op."""
    w, d = weight.detach().float(), grad.detach().float()
    if weight_decay != 0:
        d = d.add(w, alpha=weight_decay)
    if momentum != 0:
        buf = d.clone() if momentum_buffer is None else momentum_buffer.detach().float().mul(momentum).add_(d)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    return w.add(d, alpha=-lr)


def lost_in_fp16_step(old: torch.Tensor, new: torch.Tensor, fp32_new: torch.Tensor) -> float:
    """The share of the elements that the fp32 step moves (``fp32_new != old``) whose
    16-bit weight did not change in the real step (``new == old``): updates lost."""
    moved = fp32_new != old.float()
    lost = (new == old) & moved
    return lost.sum().item() / max(1, moved.sum().item())


def flushed_fraction(grad16: torch.Tensor, grad32: torch.Tensor) -> float:
    """The share of the non-zero fp32 gradient elements that are exactly zero in fp16."""
    nonzero = grad32 != 0
    return ((grad16 == 0) & nonzero).sum().item() / max(1, nonzero.sum().item())


def batches(setup: C.Setup, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (images, labels) batches :func:`common.train` feeds, in its order, with its flips."""
    (xtr, ytr), _ = C.data(setup)
    steps_per_epoch = len(ytr) // setup.batch_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(setup.epochs):
        order = torch.randperm(len(ytr), generator=g)
        for i in range(steps_per_epoch):
            idx = order[i * setup.batch_size:(i + 1) * setup.batch_size]
            x = C.normalize(xtr[idx])
            flip = torch.rand(len(idx), generator=g) < 0.5
            x[flip] = x[flip].flip(-1)
            out.append((x, ytr[idx]))
    return out


class _Probe:
    """Measures one "16-true" step: :meth:`before` after backward, :meth:`after` after
    the optimizer step."""

    def __init__(self, model: nn.Module, shadow: nn.Module) -> None:
        self.model, self.shadow = model, shadow  # the fp16 model; an fp32 copy for the exact gradients
        self.params = dict(model.named_parameters())
        self.shadow_params = dict(shadow.named_parameters())
        self.lost: dict[str, list[float]] = {name: [] for name in self.params}
        self.flushed: dict[str, list[float]] = {name: [] for name in self.params}
        self.batch = None
        self._old: dict[str, torch.Tensor] = {}
        self._fp32_new: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def _fp32_steps(self, optimizer) -> None:
        group = optimizer.param_groups[0]
        for name, p in self.params.items():
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            self._old[name] = p.detach().clone()
            self._fp32_new[name] = sgd_step_fp32(p, p.grad, buf, group["lr"], group["momentum"],
                                                 group["weight_decay"], group["nesterov"])

    def before(self, optimizer) -> None:
        self._fp32_steps(optimizer)
        x, y = self.batch
        with torch.no_grad():
            for name, p in self.params.items():
                self.shadow_params[name].copy_(p)
        self.shadow.zero_grad(set_to_none=True)
        with torch.enable_grad():
            nn.functional.cross_entropy(self.shadow(x.float()).float(), y).backward()
        for name, p in self.params.items():
            self.flushed[name].append(flushed_fraction(p.grad, self.shadow_params[name].grad))

    def after(self) -> None:
        for name, p in self.params.items():
            self.lost[name].append(lost_in_fp16_step(self._old[name], p.detach(), self._fp32_new[name]))


class _Half(nn.Module):
    """An fp16 model that takes fp32 images (for :func:`common.accuracy`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.half())


def run_16_true(setup: C.Setup, seed: int) -> dict | None:
    """Train the experiment's model as Lightning's ``precision="16-true"`` does, measuring
    every step; ``None`` (and one line printed) where Lightning is not installed."""
    try:
        import lightning
    except ImportError:
        print("lost-updates: Lightning is not installed (pip install lightning); the 16-true run is skipped")
        return None
    from ..train.schedule import lr_multiplier

    torch.manual_seed(seed)
    model = resnet9(setup.width, 10)  # fp32, as C.build makes it before converting
    shadow = copy.deepcopy(model)
    data = batches(setup, seed)
    total = len(data)

    class SixteenTrue(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.probe: _Probe | None = None

        def on_fit_start(self) -> None:  # the module is fp16 by now, converted by the precision plugin
            self.probe = _Probe(self.model, shadow)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.probe.batch = (x, y)
            return nn.functional.cross_entropy(self.model(x).float(), y)

        def on_before_optimizer_step(self, optimizer) -> None:
            self.probe.before(optimizer)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.probe.after()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=setup.lr, momentum=0.9, nesterov=True,
                                  weight_decay=setup.weight_decay)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, total, 0, "onecycle"))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = SixteenTrue()
    quiet = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [log.level for log in quiet]
    started = time.perf_counter()
    try:
        for log in quiet:
            log.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*treespec.*")  # Lightning's own deprecation notice
            trainer = lightning.Trainer(precision="16-true", accelerator="cpu", devices=1, max_epochs=1,
                                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                        enable_model_summary=False, num_sanity_val_steps=0)
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    seconds = time.perf_counter() - started
    assert all(p.dtype == torch.float16 for p in model.parameters())  # what "16-true" made of it
    _, (xva, yva) = C.data(setup)
    acc = C.accuracy(_Half(model), xva, yva)
    probe = module.probe
    return {"accuracy": acc, "lost": probe.lost, "flushed": probe.flushed, "steps": list(range(1, total + 1)),
            "seconds": seconds, "lightning": lightning.__version__}


def _mean(values) -> float:
    return sum(values) / max(1, len(values))


def _overall(history: dict[str, list[float]], names) -> float:
    """The mean over layers and steps (each layer's share counted alike)."""
    return _mean([v for name in names for v in history[name]])


def _per_step(history: dict[str, list[float]], names) -> list[float]:
    names = list(names)
    return [_mean([history[name][i] for name in names]) for i in range(len(history[names[0]]))]


def run(setup: C.Setup, seed: int, out_dir: str, doc: str, sixteen_true: bool = True) -> dict:
    started = time.perf_counter()
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
    masters_s = time.perf_counter() - started
    overall = _overall(history, history)
    true16 = run_16_true(setup, seed) if sixteen_true else None

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
    md = f"""## (a) Weight updates lost without master weights (Micikevicius et al. 2018, §3.1)

`python -m mpfp16.experiments {NAME}` — resnet9-w{setup.width} in fp16 with fp32 masters on the
embedded CIFAR-shaped data ({setup.train_images} images, {setup.epochs} epochs, batch {setup.batch_size},
one-cycle lr {setup.lr}, seed {seed}); final validation accuracy {acc:.1f}%.

For each fp16 weight tensor, the share of non-zero fp32 updates that would vanish if
added to the fp16 weight directly (`fp16(w + u) == w`), at the first, middle and
last step, and averaged over all {len(steps)} steps. Over all layers and steps:
**{100 * overall:.1f}%** of updates would be lost. The share climbs at the end of the run because
the one-cycle schedule takes the learning rate, and with it the updates, towards zero.

{chr(10).join(rows)}

![lost updates per layer]({C.link(png, doc)})
"""
    result = {"accuracy": acc, "overall_lost": overall, "history": history, "steps": steps, "seconds": masters_s}
    if sixteen_true and true16 is None:
        md += "\nLightning is not installed here, so the `precision=\"16-true\"` comparison was skipped.\n"
    elif true16 is not None:
        md += _sixteen_true_section(setup, acc, history, true16, out_dir, doc, plt)
        result["sixteen_true"] = true16
    C.write_section(doc, NAME, md)
    return result


def _sixteen_true_section(setup, acc, history, true16, out_dir, doc, plt) -> str:
    lost, flushed, steps16 = true16["lost"], true16["flushed"], true16["steps"]
    weights = list(history)  # the tensors the masters run tracks: conv and linear weights
    norms = [name for name in lost if name not in history]  # BatchNorm weights and biases, fp16 only here
    end = len(steps16) - 1
    overall16, overall_m = _overall(lost, weights), _overall(history, weights)
    last16, last_m = _mean([lost[n][end] for n in weights]), _mean([history[n][-1] for n in weights])
    norm16 = _overall(lost, norms)
    flushed_mean = _overall(flushed, weights)
    flushed_max = max(v for n in weights for v in flushed[n])

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(history[weights[0]]) + 1), [100 * v for v in _per_step(history, weights)],
            label="fp16 + masters: would be lost without masters (weights)", lw=1.5)
    ax.plot(steps16, [100 * v for v in _per_step(lost, weights)], label='"16-true": lost (weights)', lw=1.5)
    ax.plot(steps16, [100 * v for v in _per_step(lost, norms)], label='"16-true": lost (BatchNorm weights, biases)',
            lw=1, ls="--")
    ax.plot(steps16, [100 * v for v in _per_step(flushed, weights)],
            label='"16-true": weight gradients flushed to 0', lw=1, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of elements, mean over tensors (%)")
    ax.set_title('Lightning precision="16-true" against fp16 with fp32 masters')
    ax.legend(fontsize=7)
    png = f"{out_dir}/{SIXTEEN_TRUE_PNG}"
    C.savefig(fig, png)
    plt.close(fig)

    rows = ["| tensor | masters run: would be lost, mean | masters run: last step | "
            '"16-true": lost, mean | "16-true": last step | "16-true": gradients flushed to 0, mean |',
            "|---|---:|---:|---:|---:|---:|"]
    for name in weights:
        rows.append(f"| `{name}` | {100 * _mean(history[name]):.1f}% | {100 * history[name][-1]:.1f}% | "
                    f"{100 * _mean(lost[name]):.1f}% | {100 * lost[name][end]:.1f}% | "
                    f"{100 * _mean(flushed[name]):.3f}% |")
    rows.append(f"| **all weights** | **{100 * overall_m:.1f}%** | {100 * last_m:.1f}% | **{100 * overall16:.1f}%** | "
                f"{100 * last16:.1f}% | {100 * flushed_mean:.3f}% |")
    rows.append(f"| BatchNorm weights and biases ({len(norms)} tensors) | fp32, none lost | fp32 | "
                f"{100 * norm16:.1f}% | {100 * _mean([lost[n][end] for n in norms]):.1f}% | "
                f"{100 * _overall(flushed, norms):.3f}% |")
    return f"""
### Lightning's `precision="16-true"`: the same run without masters or loss scale

The same model, initial weights, data, order, flips and SGD settings (Nesterov momentum
0.9, weight decay {setup.weight_decay}, one-cycle lr {setup.lr}), trained by `lightning.Trainer(precision="16-true")`
(Lightning {true16['lightning']}): the whole module in fp16, BatchNorm included, no fp32 master copy,
no loss scale, `torch.optim.SGD` stepping the fp16 weights with its momentum in fp16 (the
loss on `logits.float()`, as in the masters run). Final validation accuracy
**{true16['accuracy']:.1f}%** (masters run: {acc:.1f}%); {true16['seconds']:.0f} s to train and measure.

**Lost** is measured, not modelled: at each of its {len(steps16)} steps, the share of the
elements that the same SGD step computed in fp32 from the same fp16 weight, gradient and
momentum buffer (upcast exactly) would move, but whose fp16 weight the real step left
unchanged. The masters-run columns are the figure above (a counterfactual on its own
trajectory). **Flushed** is the share of weight-gradient elements that are exactly 0 in
fp16 but not in an fp32 backward of the same batch from the same weights. Over all
steps, {100 * flushed_mean:.3f}% of the weight gradients were flushed (at most {100 * flushed_max:.3f}% of one
tensor at one step); activation gradients underflow far more often without a loss
scale (section (b) measured 18-28% of them flushed to zero at S = 1).

{chr(10).join(rows)}

In plain words: under `"16-true"`, {100 * overall16:.1f}% of the weight updates SGD computes never
reach the weights ({100 * last16:.1f}% at the last step, where the learning rate is near zero), and
{100 * norm16:.1f}% of the BatchNorm updates are lost too, all without a warning. With fp32 masters
these updates are kept: they accumulate in the fp32 copy until they change the fp16 weight.
{_accuracy_sentence(acc, true16['accuracy'])}

![16-true against masters]({C.link(png, doc)})
"""


def _accuracy_sentence(masters: float, sixteen_true: float) -> str:
    diff = sixteen_true - masters
    if abs(diff) < 3:
        return (f"On this short run the final accuracy moved by {diff:+.1f} points, within the few points seeds "
                "alone move it (section (c)): here the loss does not show in accuracy either.")
    return (f"On this run the final accuracy moved by {diff:+.1f} points, more than the few points seeds "
            "alone move it (section (c)).")
