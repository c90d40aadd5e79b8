"""Layers frozen and unfrozen around the optimizer, as fine-tuning does (fastai's
``fine_tune`` freezes the body, trains the head, then unfreezes): on every local path
(flat unfused and fused, per-tensor, apex compat) against plain fp32 torch over fp32
masters. The sharded path: tests/test_sharding.py."""

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.compat import apex as A
from reference import batches, make_inner, tiny_mlp

SCALE = 256.0
PATHS = ["flat", "fused", "per-tensor", "apex"]


class Fp32Reference:
    """An fp32 torch optimizer over fp32 copies of a 16-bit model's weights; a weight
    is stepped when its parameter requires grad, as torch steps a parameter that has a
    gradient."""

    def __init__(self, model, kind):
        self.model = model
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        self.opt = make_inner(kind, self.masters)

    def train(self, data):
        for x, y in data:
            for p in self.params:
                p.grad = None
            (nn.functional.cross_entropy(self.model(x), y).float() * SCALE).backward()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    if not p.requires_grad:
                        m.grad = None
                        continue
                    grad = p.grad.float() * torch.tensor(1 / SCALE)
                    if m is p:
                        p.grad = grad
                    else:
                        m.grad = grad
                self.opt.step()
                for p, m in zip(self.params, self.masters):
                    if m is not p:
                        p.copy_(m)


def hold_gradient_hooks(model):
    """What DDP's reducer keeps of each parameter: its gradient accumulator. Moving a
    parameter after this would cut the hook off, so the optimizer must leave it."""
    return [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters() if p.requires_grad]


def build(path, model, kind):
    """(model, optimizer with .step/.backward/.zero_grad, its FP16Optimizer)."""
    if path == "per-tensor":
        with torch.no_grad():  # out of the flat buffers, as a .half() model is
            for p in model.parameters():
                p.data = p.detach().clone()
        model._held = hold_gradient_hooks(model)
    inner = make_inner(kind, model.parameters())
    if path == "apex":
        opt = A.FP16_Optimizer(inner, static_loss_scale=SCALE, verbose=False)
        return opt, opt._opt
    opt = mpfp16.FP16Optimizer(inner, loss_scale=SCALE, fused=path == "fused")
    assert opt.store.kind == ("per-tensor" if path == "per-tensor" else "flat")
    return opt, opt


def train(opt, model, data):
    for x, y in data:
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()


def pair(frozen_at_build: bool):
    models = [mpfp16.to_half(tiny_mlp(0)) for _ in range(2)]
    if frozen_at_build:
        for m in models:
            m[0].weight.requires_grad_(False)
    return models


def assert_close_to_reference(model, ref_model, exact: bool):
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if exact:
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        else:  # the fused Adam step: torch's CPU sqrt is not correctly rounded
            torch.testing.assert_close(p.float(), q.float(), rtol=2e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("path", PATHS)
def test_a_layer_frozen_at_build_and_unfrozen_later_trains_through_its_master(path, kind):
    """5 steps with the first layer frozen (it must not move), then 5 with it unfrozen:
    the same weights as plain fp32 torch that steps it from the moment it has gradients."""
    model, ref_model = pair(frozen_at_build=True)
    opt, core = build(path, model, kind)
    frozen = model[0].weight.detach().clone()
    ref = Fp32Reference(ref_model, kind)
    data = batches(10)
    train(opt, model, data[:5])
    ref.train(data[:5])
    assert torch.equal(model[0].weight, frozen)
    assert core.skipped_steps == 0
    for m in (model, ref_model):
        m[0].weight.requires_grad_(True)
    train(opt, model, data[5:])
    ref.train(data[5:])
    assert not torch.equal(model[0].weight, frozen)
    moved = (model[0].weight.float() - frozen.float()).abs().max().item()
    assert moved < 0.1, f"moved by {moved}: the loss-scaled gradient, not the unscaled one"
    assert_close_to_reference(model, ref_model, exact=not (path == "fused" and kind == "adamw"))
    master = core.master_params()[0]
    assert master.dtype == torch.float32 and torch.equal(master.to(model[0].weight.dtype), model[0].weight)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("path", PATHS)
def test_a_layer_frozen_mid_run_stops_moving_and_its_momentum_is_not_applied(path, kind):
    model, ref_model = pair(frozen_at_build=False)
    opt, core = build(path, model, kind)
    ref = Fp32Reference(ref_model, kind)
    data = batches(6)
    train(opt, model, data[:3])
    ref.train(data[:3])
    for m in (model, ref_model):
        m[0].weight.requires_grad_(False)
    weight = model[0].weight.detach().clone()
    master = core.master_params()[0]
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in core.state[master].items()}
    train(opt, model, data[3:])
    ref.train(data[3:])
    assert torch.equal(model[0].weight, weight)
    for key, value in state.items():  # momentum, moments and step count stay where they were
        assert torch.equal(torch.as_tensor(core.state[master][key]), torch.as_tensor(value)), key
    assert_close_to_reference(model, ref_model, exact=not (path == "fused" and kind == "adamw"))


def test_an_optimizer_over_the_trainable_parameters_alone_moves_nothing():
    """torch users often build the optimizer over ``filter(requires_grad)``: to_half gives
    frozen parameters buffers of their own, so both that and the optimizer over every
    parameter adopt the buffers as they are."""
    for over_all in (False, True):
        model = tiny_mlp(0)
        model[0].requires_grad_(False)
        mpfp16.to_half(model)
        where = [p.data_ptr() for p in model.parameters()]
        params = model.parameters() if over_all else [p for p in model.parameters() if p.requires_grad]
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(params, lr=0.1))
        assert opt.store.kind == "flat"
        assert [p.data_ptr() for p in model.parameters()] == where
