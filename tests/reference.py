"""The tests' models, data and references for a mixed-precision step.

:class:`ReferenceTrainer` is the library's definition of the step
(:class:`mpfp16.reference.ReferenceStep`: per tensor, in plain torch, what FP16Optimizer
does with flat buffers: fp16 forward and backward on the scaled loss, fp32 copies of the
weights stepped by an ordinary torch optimizer on the unscaled gradients, a copy back
into the 16-bit model) with a static scale; tests/test_reference.py holds the definition
to plain torch and ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mpfp16.reference import ReferenceStep
from mpfp16.scaler import LossScaler


def tiny_mlp(seed: int = 0, norm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16)]
    if norm:
        layers.append(nn.LayerNorm(16))
    layers += [nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def batches(n: int, seed: int = 1, batch: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def make_inner(kind: str, params, lr: float = 0.05, **kw):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4, **kw)
    if kind == "nesterov":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr / 10, weight_decay=1e-4, **kw)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr / 10, weight_decay=1e-2, **kw)
    if kind == "adagrad":  # fills its state when it is built
        return torch.optim.Adagrad(params, lr=lr, initial_accumulator_value=0.1, weight_decay=1e-4, **kw)
    raise ValueError(kind)


OPTIMIZERS = ["sgd", "nesterov", "adam", "adamw"]


class ReferenceTrainer(ReferenceStep):
    """The library's definition of the step (mpfp16/reference.py) over a 16-bit model,
    with a static loss scale and a reference.make_inner optimizer.

    master_weights=False re-creates the fp32 weights from the 16-bit ones at every
    step (the optimizer's own state persists), which is what stepping the 16-bit
    weights directly with fp32 arithmetic means.
    """

    def __init__(self, model16: nn.Module, kind: str, scale: float = 1.0, master_weights: bool = True,
                 max_grad_norm: float | None = None, **kw):
        self.model = model16
        super().__init__(model16.parameters(), lambda masters: make_inner(kind, masters, **kw),
                         scaler=LossScaler(scale), max_grad_norm=max_grad_norm, master_weights=master_weights)
        self.scale = scale

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.optimizer

    @opt.setter
    def opt(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def train_reference(model16, kind, data, scale=1.0, accum=1, **kw):
    ref = ReferenceTrainer(model16, kind, scale=scale, **kw)
    for i in range(0, len(data), accum):
        for x, y in data[i:i + accum]:
            ref.backward(nn.functional.cross_entropy(model16(x), y) / accum)
        ref.step()
    return ref


def train_mpfp16(model16, opt, data, accum=1):
    results = []
    for i in range(0, len(data), accum):
        opt.zero_grad()
        for x, y in data[i:i + accum]:
            opt.backward(nn.functional.cross_entropy(model16(x), y) / accum)
        results.append(opt.step())
    return results


def backward_both(model16, opt, ref_model, ref, x, y):
    """The same batch's backward through an FP16Optimizer and through the reference."""
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model16(x), y))
    ref.backward(nn.functional.cross_entropy(ref_model(x), y))


def step_both(model16, opt, ref_model, ref, x, y) -> bool:
    """One step of both; returns whether the FP16Optimizer stepped."""
    backward_both(model16, opt, ref_model, ref, x, y)
    stepped = opt.step()
    ref.step()
    return stepped


def assert_same_params(a: nn.Module, b: nn.Module):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == q.dtype, name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def adam_by_hand(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, decoupled, sqrt):
    """torch's single-tensor Adam, op for op, with the square root given."""
    beta1, beta2 = betas
    if weight_decay:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (sqrt(exp_avg_sq) / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """A correctly rounded fp32 square root (through fp64): mpfp16's kernels' sqrt,
    which torch's CPU sqrt kernel is not."""
    return t.double().sqrt().float()


def saved_masters(state_dict: dict) -> list:
    """An FP16Optimizer state_dict's fp32 masters of its 16-bit parameters, in the
    optimizer's order (None for an fp32 parameter, and where none is kept)."""
    return [e["master"] if e["dtype"] not in ("float32", None) else None for e in state_dict["params"].values()]
