"""What the experiments share: the embedded CIFAR-shaped data, a small ResNet trained
in a chosen precision mode, and the writer of docs/EXPERIMENTS.md sections."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..convert import to_half
from ..train.data import synthetic_images
from ..train.models import resnet9
from ..optimizer import FP16Optimizer
from ..train.schedule import lr_multiplier

MODES = {  # name -> (dtype, master weights, rounding)
    "fp32": (torch.float32, True, "nearest"),
    "fp16 + masters": (torch.float16, True, "nearest"),
    "fp16, no masters, nearest": (torch.float16, False, "nearest"),
    "fp16, no masters, stochastic": (torch.float16, False, "stochastic"),
    "fp16, no masters, kahan": (torch.float16, False, "kahan"),
    "bf16 + masters": (torch.bfloat16, True, "nearest"),
}


@dataclass
class Setup:
    """A training run small enough for a 2-core CPU."""

    width: int = 8
    train_images: int = 2000
    val_images: int = 1000
    epochs: int = 3
    batch_size: int = 128
    lr: float = 0.4
    weight_decay: float = 5e-4


def quick(setup: Setup) -> Setup:
    """The same experiment in seconds (tests)."""
    return Setup(width=4, train_images=128, val_images=64, epochs=1, batch_size=32, lr=setup.lr)


_DATA: dict = {}


def data(setup: Setup):
    key = (setup.train_images, setup.val_images)
    if key not in _DATA:
        _DATA[key] = (synthetic_images(setup.train_images, 32, 10, seed=1), synthetic_images(setup.val_images, 32, 10, seed=2))
    return _DATA[key]


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - 0.5) / 0.25


def build(mode: str, setup: Setup, seed: int, loss_scale="dynamic", **opt_kw):
    dtype, master_weights, rounding = MODES[mode]
    torch.manual_seed(seed)
    model = resnet9(setup.width, 10)
    if dtype != torch.float32:
        to_half(model, dtype)
    inner = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=0.9, nesterov=True,
                            weight_decay=setup.weight_decay)
    opt = FP16Optimizer(inner, loss_scale=loss_scale if dtype == torch.float16 else None,
                        master_weights=master_weights, rounding=rounding, rounding_seed=seed, fused=False,
                        **opt_kw)
    return model, opt


def train(model, opt, setup: Setup, seed: int, on_step=None, on_before_step=None) -> float:
    """Train with a one-cycle schedule and random flips; return validation accuracy (%).

    ``on_before_step(step)`` runs after backward, ``on_step(step, stepped)`` after the
    optimizer step."""
    (xtr, ytr), (xva, yva) = data(setup)
    steps_per_epoch = len(ytr) // setup.batch_size
    total = steps_per_epoch * setup.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, total, 0, "onecycle"))
    g = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(setup.epochs):
        order = torch.randperm(len(ytr), generator=g)
        model.train()
        for i in range(steps_per_epoch):
            idx = order[i * setup.batch_size:(i + 1) * setup.batch_size]
            x = normalize(xtr[idx])
            flip = torch.rand(len(idx), generator=g) < 0.5
            x[flip] = x[flip].flip(-1)
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x).float(), ytr[idx]))
            if on_before_step:
                on_before_step(step)
            stepped = opt.step()
            sched.step()
            step += 1
            if on_step:
                on_step(step, stepped)
    return accuracy(model, xva, yva)


@torch.no_grad()
def accuracy(model, images, labels, batch: int = 250) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(labels), batch):
        correct += (model(normalize(images[i:i + batch])).float().argmax(1) == labels[i:i + batch]).sum().item()
    model.train()
    return 100.0 * correct / len(labels)


def write_section(doc: str, name: str, markdown: str) -> None:
    """Replace (or append) the section between this experiment's markers in ``doc``."""
    start, end = f"<!-- experiment:{name} -->", f"<!-- /experiment:{name} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = open(doc).read() if os.path.exists(doc) else "# Experiments\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(doc)), exist_ok=True)
    with open(doc, "w") as f:
        f.write(text)


def savefig(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def link(path: str, doc: str) -> str:
    """``path`` relative to the folder of ``doc``, for a markdown image link."""
    return os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(doc)))
